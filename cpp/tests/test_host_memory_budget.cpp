// Unit tests of the host arena's own_pages blocks and its page-lock budget (partial slabs, the
// fallback to ordinary memory, unpinning the cache to make room, re-carving a free slab) with the
// fake page-locking driver (fake_driver.h), so that they run without a GPU (ctest).
#include <set>
#include <vector>

#include "fake_driver.h"
#include "ramstream/host_memory.h"

using namespace ramstream;
using namespace ramstream::test;

namespace {

// own_pages blocks: dedicated at any size (4096-byte granule), reused from the cache like large
// ones, and given back to the driver in full by trim() while slab blocks keep their slab pinned.
void test_own_pages() {
  fake::reset();
  HostArena a(fake::driver);
  void* keep = alloc(a, 100 * 1024);  // a slab block that stays live: its slab stays pinned
  std::vector<void*> big;
  for (int i = 0; i < 6; ++i) {
    void* p = nullptr;
    CHECK_OK(a.allocate(300 * 1024 + 1, &p, nullptr, true));
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
    big.push_back(p);
  }
  HostMemoryStats s = a.stats();
  const std::uint64_t own = 6 * ((300 * 1024 + 1 + 4095) / 4096 * 4096);
  CHECK(s.slabs == 1 && s.dedicated_blocks == 6);
  CHECK(s.bytes_pinned == 64 * MiB + own);
  CHECK_OK(a.release(big[0]));
  void* again = nullptr;
  CHECK_OK(a.allocate(300 * 1024, &again, nullptr, true));  // the cached block, no driver call
  CHECK(again == big[0] && a.stats().pin_calls == 7);
  big[0] = again;
  for (void* p : big) CHECK_OK(a.release(p));
  check_invariants(a);
  CHECK_OK(a.trim());
  s = a.stats();
  CHECK(s.dedicated_blocks == 0 && s.bytes_pinned == 64 * MiB);  // all of it back; the slab stays
  CHECK_OK(a.release(keep));
  CHECK_OK(a.trim());
  CHECK(a.stats().bytes_pinned == 0);
  check_invariants(a);
}

void test_budget_partial_slab_and_fallback() {
  fake::reset();
  HostArena a(fake::driver);
  CHECK_OK(a.set_budget(10 * MiB));
  bool pinned = false;
  void* p = alloc(a, 5000, &pinned);
  CHECK(pinned && a.stats().bytes_pinned == 10 * MiB);  // a slab cut to the budget
  void* q = alloc(a, 8 * MiB, &pinned);  // fits the slab's tail
  CHECK(pinned && a.stats().pin_calls == 1);
  void* r = alloc(a, 4 * MiB, &pinned);  // no room: ordinary memory
  CHECK(!pinned && !a.is_pinned(r));
  HostMemoryStats s = a.stats();
  CHECK(s.fallback_allocations == 1 && s.fallback_bytes_in_use == 4 * MiB);
  CHECK(s.fallback_reason.find("budget") != std::string::npos);
  CHECK(s.bytes_pinned <= s.budget);
  void* d = alloc(a, 40 * MiB, &pinned);  // dedicated, over budget
  CHECK(!pinned && a.stats().fallback_allocations == 2);
  check_invariants(a);
  for (void* x : {p, q, r, d}) CHECK_OK(a.release(x));
  CHECK(a.stats().fallback_bytes_in_use == 0 && a.stats().bytes_in_use == 0);
  // Lowering the budget unpins what is cached.
  CHECK_OK(a.set_budget(0));
  CHECK(a.stats().bytes_pinned == 0 && a.stats().slabs == 0);
  void* z = alloc(a, 0, &pinned);  // zero bytes: a valid minimal block
  CHECK(!pinned && a.stats().bytes_in_use == 4096);
  CHECK_OK(a.release(z));
  check_invariants(a);
}

void test_make_room_unpins_cache() {
  fake::reset();
  HostArena a(fake::driver);
  CHECK_OK(a.set_budget(70 * MiB));
  void* big = alloc(a, 40 * MiB);
  CHECK_OK(a.release(big));  // cached dedicated block
  void* small = alloc(a, 5000);
  CHECK(a.stats().bytes_pinned == 70 * MiB);  // 40 + a 30 MiB slab (the headroom)
  CHECK_OK(a.release(small));
  bool pinned = false;
  void* huge = alloc(a, 60 * MiB, &pinned);  // needs the cache unpinned first
  HostMemoryStats s = a.stats();
  CHECK(pinned && s.bytes_pinned == 60 * MiB && s.unpin_calls == 2 && s.slabs == 0);
  CHECK(s.fallback_allocations == 0);
  CHECK_OK(a.release(huge));
  // A budget the cache cannot make room for: nothing is unpinned in vain.
  void* b2 = alloc(a, 5 * MiB, &pinned);  // headroom 10 MiB: a 10 MiB slab
  CHECK(pinned && a.stats().bytes_pinned == 70 * MiB);
  void* b3 = alloc(a, 66 * MiB, &pinned);  // 66 > 60 cached + 0 headroom: fallback
  CHECK(!pinned && a.stats().bytes_pinned == 70 * MiB && a.stats().unpin_calls == 2);
  CHECK_OK(a.release(b2));
  CHECK_OK(a.release(b3));
  check_invariants(a);
}

void test_reclaim_free_slab() {
  fake::reset();
  HostArena a(fake::driver);
  CHECK_OK(a.set_budget(64 * MiB));
  void* blocks[4];
  for (auto& b : blocks) b = alloc(a, 16 * MiB);  // fills the one slab exactly
  CHECK(a.stats().pin_calls == 1 && a.stats().slabs == 1);
  for (auto& b : blocks) CHECK_OK(a.release(b));
  bool pinned = false;
  void* x = alloc(a, 12 * MiB, &pinned);  // another class: the free slab is re-carved
  void* y = alloc(a, 16 * MiB, &pinned);
  void* z = alloc(a, 16 * MiB, &pinned);
  void* w = alloc(a, 16 * MiB, &pinned);
  CHECK(pinned && a.stats().pin_calls == 1 && a.stats().fallback_allocations == 0);
  std::set<char*> starts{static_cast<char*>(x), static_cast<char*>(y), static_cast<char*>(z),
                         static_cast<char*>(w)};
  CHECK(starts.size() == 4);
  char* prev_end = nullptr;
  for (char* p : starts) {
    CHECK(p >= prev_end);
    prev_end = p + (p == x ? 12 * MiB : 16 * MiB);
  }
  void* v = alloc(a, 16 * MiB, &pinned);  // 12 + 3 * 16 = 60: no room left in budget
  CHECK(!pinned);
  for (void* p : {x, y, z, w, v}) CHECK_OK(a.release(p));
  check_invariants(a);
}

}  // namespace

int main() {
  test_own_pages();
  test_budget_partial_slab_and_fallback();
  test_make_room_unpins_cache();
  test_reclaim_free_slab();
  return report("test_host_memory_budget");
}
