// The pinned host arena: size-class slabs, dedicated large blocks, budget, registration, fallback
// (size classes and budget parsing: host_memory_sizes.cpp; the driver: host_memory_driver.cpp).
#include "ramstream/host_memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <unordered_set>

#include "host_memory_internal.h"

namespace ramstream {

using detail::fmt_ptr;
using detail::kMaxRequest;
using detail::round_up;

namespace {

std::string fmt_bytes(std::uint64_t b) {
  char buf[64];
  const double g = static_cast<double>(b) / double(1 << 30);
  if (b >= (std::uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%llu bytes (%.2f GiB)", static_cast<unsigned long long>(b), g);
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes (%.2f MiB)", static_cast<unsigned long long>(b),
                  static_cast<double>(b) / double(1 << 20));
  }
  return buf;
}

bool in_ranges(const std::map<std::uintptr_t, std::size_t>& ranges, std::uintptr_t p) {
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return false;
  --it;
  return p < it->first + it->second;
}

bool overlaps(const std::map<std::uintptr_t, std::size_t>& ranges, std::uintptr_t p,
              std::size_t bytes) {
  auto it = ranges.lower_bound(p + bytes);  // first range starting at or after the end
  if (it == ranges.begin()) return false;
  --it;
  return it->first + it->second > p;
}

}  // namespace

// ---- HostArena -------------------------------------------------------------------------------

HostArena::HostArena(const PinDriver& driver) : driver_(driver) {
  physical_ = physical_memory_bytes();
  if (physical_ > 0) {
    budget_ = static_cast<std::uint64_t>(static_cast<double>(physical_) * kDefaultBudgetFraction);
    budget_source_ = "default (50% of physical RAM)";
  } else {
    budget_ = std::uint64_t{4} << 30;
    budget_source_ = "default (4 GiB: physical RAM unknown)";
  }
  if (const char* env = std::getenv("RAMSTREAM_PIN_BUDGET"); env && *env) {
    std::uint64_t v = 0;
    Status s = parse_byte_size(env, physical_, &v);
    if (s.is_ok()) {
      budget_ = v;
      budget_source_ = std::string("RAMSTREAM_PIN_BUDGET=") + env;
    } else {
      budget_error_ = "RAMSTREAM_PIN_BUDGET ignored: " + s.message();
    }
  }
}

HostArena::~HostArena() {
  std::unique_lock<std::mutex> lock(mu_);
  for (auto& s : slabs_) driver_.unpin(device_, s->base);
  for (auto& kv : live_) {
    if (kv.second.kind == Kind::kDedicated) driver_.unpin(device_, kv.first);
    if (kv.second.kind == Kind::kFallback) std::free(kv.first);
  }
  for (auto& kv : free_dedicated_) driver_.unpin(device_, kv.second);
  for (auto& kv : registered_ranges_)
    (void)driver_.unregister_range(device_, reinterpret_cast<void*>(kv.first));
}

bool HostArena::pinning_available_locked() const {
  if (pinning_state_ < 0) {
    no_pinning_reason_ = driver_.availability();
    pinning_state_ = no_pinning_reason_.empty() ? 1 : 0;
  }
  return pinning_state_ == 1;
}

std::uint64_t HostArena::unpinnable_locked() const {
  std::uint64_t total = 0;
  for (const auto& kv : free_dedicated_) total += kv.first;
  for (const auto& s : slabs_)
    if (s->live == 0) total += s->bytes;
  return total;
}

void HostArena::unpin_cached_locked(std::unique_lock<std::mutex>& lock, std::uint64_t amount) {
  std::vector<void*> victims;
  std::uint64_t got = 0;
  while (got < amount && !free_dedicated_.empty()) {
    auto it = std::prev(free_dedicated_.end());
    victims.push_back(it->second);
    got += it->first;
    pinned_ranges_.erase(reinterpret_cast<std::uintptr_t>(it->second));
    free_dedicated_.erase(it);
    --dedicated_count_;
  }
  std::unordered_set<const Slab*> dead;
  for (const auto& s : slabs_) {
    if (got >= amount) break;
    if (s->live != 0) continue;
    dead.insert(s.get());
    victims.push_back(s->base);
    got += s->bytes;
    pinned_ranges_.erase(reinterpret_cast<std::uintptr_t>(s->base));
  }
  if (!dead.empty()) {
    for (auto it = free_.begin(); it != free_.end();) {
      auto& v = it->second;
      v.erase(std::remove_if(v.begin(), v.end(),
                             [&](const FreeBlock& f) { return dead.count(f.slab) != 0; }),
              v.end());
      it = v.empty() ? free_.erase(it) : std::next(it);
    }
    slabs_.erase(std::remove_if(slabs_.begin(), slabs_.end(),
                                [&](const std::unique_ptr<Slab>& s) { return dead.count(s.get()) != 0; }),
                 slabs_.end());
    current_slab_ = 0;
  }
  if (victims.empty()) return;
  // The bytes stay counted in pinned_ until the driver has them back.
  const int device = device_;
  lock.unlock();
  for (void* p : victims) driver_.unpin(device, p);
  lock.lock();
  pinned_ -= got;
  unpin_calls_ += victims.size();
}

bool HostArena::make_room_locked(std::unique_lock<std::mutex>& lock, std::uint64_t need) {
  const std::uint64_t total = locked_total_locked();
  if (total + need <= budget_) return true;
  const std::uint64_t deficit = total + need - budget_;
  if (unpinnable_locked() < deficit) return false;
  unpin_cached_locked(lock, deficit);
  return locked_total_locked() + need <= budget_;
}

void* HostArena::carve_locked(Slab* slab, std::size_t cls) {
  void* p = slab->base + slab->used;
  slab->used += cls;
  ++slab->live;
  return p;
}

void HostArena::account_alloc_locked(void* p, const Block& b) {
  live_[p] = b;
  in_use_ += b.bytes;
  requested_ += b.requested;
  peak_ = std::max(peak_, in_use_);
  ++allocations_;
  if (b.kind == Kind::kFallback) {
    fallback_in_use_ += b.bytes;
    ++fallback_count_;
  }
}

Status HostArena::fallback_locked(std::size_t bytes, const std::string& reason, void** out) {
  const std::size_t rounded = round_up(std::max<std::size_t>(bytes, 1), kAlignment);
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return Status::oom("host allocation of " + fmt_bytes(bytes) +
                       " failed: page-locked memory unavailable (" + reason +
                       ") and ordinary memory (aligned_alloc of " + fmt_bytes(rounded) +
                       ") failed too; arena in use " + fmt_bytes(in_use_) + ", pinned " +
                       fmt_bytes(pinned_) + ", registered " + fmt_bytes(registered_) +
                       ", page-lock budget " + fmt_bytes(budget_) + ", physical RAM " +
                       fmt_bytes(physical_));
  }
  fallback_reason_ = reason;
  account_alloc_locked(p, Block{rounded, bytes, Kind::kFallback, nullptr});
  *out = p;
  return Status::ok();
}

Status HostArena::allocate(std::size_t bytes, void** out, bool* pinned, bool own_pages) {
  if (out == nullptr) return Status::invalid("allocate: out is null");
  *out = nullptr;
  if (pinned) *pinned = false;
  std::unique_lock<std::mutex> lock(mu_);
  if (bytes > kMaxRequest)
    return Status::oom("allocate: " + fmt_bytes(bytes) + " is more than any host has (in use " +
                       fmt_bytes(in_use_) + ", page-lock budget " + fmt_bytes(budget_) +
                       ", physical RAM " + fmt_bytes(physical_) + ")");
  if (!pinning_available_locked()) return fallback_locked(bytes, no_pinning_reason_, out);

  const std::size_t req = std::max<std::size_t>(bytes, 1);
  const bool dedicated = own_pages || req > kMaxSlabBlock;
  const std::size_t cls = !dedicated ? host_size_class(req)
                          : own_pages ? round_up(req, kAlignment)
                                      : round_up(req, kDedicatedGranule);

  for (int attempt = 0;; ++attempt) {
    // 1. A cached block of the right size: no driver call.
    if (!dedicated) {
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        FreeBlock f = it->second.back();
        it->second.pop_back();
        ++f.slab->live;
        ++reuse_hits_;
        account_alloc_locked(f.ptr, Block{cls, bytes, Kind::kSlab, f.slab});
        *out = f.ptr;
        if (pinned) *pinned = true;
        return Status::ok();
      }
      // 2. The uncarved tail of a slab (the hint first), then a fully free slab, re-carved.
      Slab* target = nullptr;
      const std::size_t ns = slabs_.size();
      for (std::size_t k = 0; k < ns && target == nullptr; ++k) {
        Slab* s = slabs_[(current_slab_ + k) % ns].get();
        if (s->bytes - s->used >= cls) {
          target = s;
          current_slab_ = (current_slab_ + k) % ns;
        }
      }
      for (std::size_t k = 0; k < ns && target == nullptr; ++k) {
        Slab* s = slabs_[k].get();
        if (s->live == 0 && s->bytes >= cls) {
          for (auto fit = free_.begin(); fit != free_.end();) {
            auto& v = fit->second;
            v.erase(std::remove_if(v.begin(), v.end(),
                                   [&](const FreeBlock& f) { return f.slab == s; }),
                    v.end());
            fit = v.empty() ? free_.erase(fit) : std::next(fit);
          }
          s->used = 0;
          target = s;
          current_slab_ = k;
        }
      }
      if (target != nullptr) {
        void* p = carve_locked(target, cls);
        account_alloc_locked(p, Block{cls, bytes, Kind::kSlab, target});
        *out = p;
        if (pinned) *pinned = true;
        return Status::ok();
      }
    } else {
      auto it = free_dedicated_.lower_bound(cls);
      if (it != free_dedicated_.end() && it->first <= cls + cls / 4) {
        void* p = it->second;
        const std::size_t size = it->first;
        free_dedicated_.erase(it);
        ++reuse_hits_;
        account_alloc_locked(p, Block{size, bytes, Kind::kDedicated, nullptr});
        *out = p;
        if (pinned) *pinned = true;
        return Status::ok();
      }
    }

    // 3. New page-locked memory, within the budget (unpinning cached memory once if needed).
    if (headroom_locked() < cls) {
      if (attempt == 0 && make_room_locked(lock, cls)) continue;  // state may have changed
      return fallback_locked(
          bytes,
          "page-lock budget exceeded: request of " + fmt_bytes(bytes) + " needs " +
              fmt_bytes(cls) + " more pinned memory; pinned " + fmt_bytes(pinned_) +
              " + registered " + fmt_bytes(registered_) + " + being pinned " +
              fmt_bytes(reserved_) + ", budget " + fmt_bytes(budget_) +
              " (raise it with RAMSTREAM_PIN_BUDGET or set_pin_budget)",
          out);
    }
    std::size_t pin_bytes = cls;
    if (!dedicated) {
      const std::uint64_t room = headroom_locked() / kDedicatedGranule * kDedicatedGranule;
      pin_bytes = std::max<std::size_t>(cls, std::min<std::uint64_t>(kSlabBytes, room));
    }
    reserved_ += pin_bytes;
    const int device = device_;
    lock.unlock();
    void* base = nullptr;
    Status s = driver_.pin(device, pin_bytes, &base);
    lock.lock();
    reserved_ -= pin_bytes;
    if (!s.is_ok()) return fallback_locked(bytes, s.message(), out);
    ++pin_calls_;
    pinned_ += pin_bytes;
    pinned_ranges_[reinterpret_cast<std::uintptr_t>(base)] = pin_bytes;
    if (dedicated) {
      ++dedicated_count_;
      account_alloc_locked(base, Block{pin_bytes, bytes, Kind::kDedicated, nullptr});
      *out = base;
    } else {
      auto slab = std::make_unique<Slab>();
      slab->base = static_cast<char*>(base);
      slab->bytes = pin_bytes;
      Slab* sp = slab.get();
      slabs_.push_back(std::move(slab));
      current_slab_ = slabs_.size() - 1;
      void* p = carve_locked(sp, cls);
      account_alloc_locked(p, Block{cls, bytes, Kind::kSlab, sp});
      *out = p;
    }
    if (pinned) *pinned = true;
    return Status::ok();
  }
}

Status HostArena::release(void* ptr) {
  if (ptr == nullptr) return Status::ok();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    return Status::invalid("release: " + fmt_ptr(ptr) +
                           " was not allocated by the host arena or was already released");
  const Block b = it->second;
  live_.erase(it);
  in_use_ -= b.bytes;
  requested_ -= b.requested;
  switch (b.kind) {
    case Kind::kSlab:
      --b.slab->live;
      free_[b.bytes].push_back(FreeBlock{ptr, b.slab});
      break;
    case Kind::kDedicated: free_dedicated_.emplace(b.bytes, ptr); break;
    case Kind::kFallback:
      fallback_in_use_ -= b.bytes;
      std::free(ptr);
      break;
  }
  return Status::ok();
}

Status HostArena::trim() {
  std::unique_lock<std::mutex> lock(mu_);
  unpin_cached_locked(lock, std::numeric_limits<std::uint64_t>::max());
  return Status::ok();
}

Status HostArena::set_budget(std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  budget_ = bytes;
  budget_source_ = "set_budget";
  const std::uint64_t total = locked_total_locked();
  if (total > budget_) unpin_cached_locked(lock, total - budget_);
  return Status::ok();
}

std::uint64_t HostArena::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

Status HostArena::set_device(int device) {
  if (device < -1) return Status::invalid("set_device: device must be >= -1, got " + std::to_string(device));
  std::lock_guard<std::mutex> lock(mu_);
  device_ = device;
  return Status::ok();
}

Status HostArena::register_memory(void* ptr, std::size_t bytes) {
  if (ptr == nullptr) return Status::invalid("register_memory: pointer is null");
  if (bytes == 0) return Status::invalid("register_memory: size must be > 0 bytes");
  std::unique_lock<std::mutex> lock(mu_);
  if (!pinning_available_locked())
    return Status::unsupported("register_memory: page-locking needs CUDA: " + no_pinning_reason_);
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  if (overlaps(registered_ranges_, p, bytes))
    return Status::invalid("register_memory: [" + fmt_ptr(ptr) + ", +" + std::to_string(bytes) +
                           ") overlaps memory already registered");
  if (overlaps(pinned_ranges_, p, bytes))
    return Status::invalid("register_memory: " + fmt_ptr(ptr) +
                           " lies in memory the arena already page-locked");
  if (!make_room_locked(lock, bytes))
    return Status::oom("register_memory: " + fmt_bytes(bytes) + " would exceed the page-lock budget: pinned " +
                       fmt_bytes(pinned_) + " + registered " + fmt_bytes(registered_) +
                       " + being pinned " + fmt_bytes(reserved_) + " + " + fmt_bytes(bytes) +
                       " > budget " + fmt_bytes(budget_) +
                       " (raise it with RAMSTREAM_PIN_BUDGET or set_pin_budget)");
  reserved_ += bytes;
  const int device = device_;
  lock.unlock();
  Status s = driver_.register_range(device, ptr, bytes);
  lock.lock();
  reserved_ -= bytes;
  RAMSTREAM_RETURN_IF_ERROR(s);
  registered_ += bytes;
  registered_ranges_[p] = bytes;
  return Status::ok();
}

Status HostArena::unregister_memory(void* ptr) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!pinning_available_locked())
    return Status::unsupported("unregister_memory: page-locking needs CUDA: " + no_pinning_reason_);
  auto it = registered_ranges_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == registered_ranges_.end())
    return Status::invalid("unregister_memory: " + fmt_ptr(ptr) +
                           " is not the start of memory registered with register_memory");
  const std::size_t bytes = it->second;
  registered_ranges_.erase(it);
  const int device = device_;
  lock.unlock();
  Status s = driver_.unregister_range(device, ptr);
  lock.lock();
  if (!s.is_ok()) {
    registered_ranges_[reinterpret_cast<std::uintptr_t>(ptr)] = bytes;  // still page-locked
    return s;
  }
  registered_ -= bytes;
  return Status::ok();
}

Status HostArena::device_pointer(void* host, void** dev) {
  if (host == nullptr || dev == nullptr) return Status::invalid("device_pointer: null pointer");
  *dev = nullptr;
  int device;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pinning_available_locked())
      return Status::unsupported("device_pointer: mapped host memory needs CUDA: " +
                                 no_pinning_reason_);
    device = device_;
  }
  return driver_.device_pointer(device, host, dev);
}

bool HostArena::is_pinned(const void* ptr) const {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  return in_ranges(pinned_ranges_, p) || in_ranges(registered_ranges_, p);
}

HostMemoryStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostMemoryStats s;
  s.bytes_pinned = pinned_;
  s.bytes_in_use = in_use_;
  s.bytes_requested = requested_;
  s.bytes_cached = pinned_ - (in_use_ - fallback_in_use_);
  s.peak_bytes_in_use = peak_;
  s.bytes_registered = registered_;
  s.fallback_allocations = fallback_count_;
  s.fallback_bytes_in_use = fallback_in_use_;
  s.pin_calls = pin_calls_;
  s.unpin_calls = unpin_calls_;
  s.budget = budget_;
  s.allocations = allocations_;
  s.reuse_hits = reuse_hits_;
  s.slabs = slabs_.size();
  s.dedicated_blocks = dedicated_count_;
  s.physical_memory = physical_;
  s.pinning_available = pinning_available_locked();
  s.fallback_reason = fallback_reason_;
  s.budget_source = budget_source_;
  s.budget_error = budget_error_;
  return s;
}

void HostArena::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
}

HostArena& global_arena() {
  static HostArena* arena = new HostArena();  // never destroyed: blocks may outlive main()
  return *arena;
}

}  // namespace ramstream
