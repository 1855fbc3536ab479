// The pinned host memory arena: page-locked slabs carved into size classes, a page-lock budget,
// registration of existing host memory, and a visible fallback to ordinary memory.
//
// Layout. Requests up to kMaxSlabBlock bytes are rounded up to a size class (powers of two with
// four sub-steps, multiples of 4096, at least 4096 bytes) and carved from 64 MiB page-locked slabs
// (Portable | Mapped; blocks of 64 MiB and more as an anonymous mapping first-touched by up to 16
// threads and then cudaHostRegister'ed, 10x faster than cudaHostAlloc, which the smaller ones and
// RAMSTREAM_PIN_METHOD=alloc use: host_pages.h). Larger requests get one dedicated page-locked allocation,
// rounded up to 2 MiB (own_pages requests: any size, rounded up to 4096 bytes). A released block goes to a cache (per size class; dedicated blocks by
// size) and is handed out again without a new driver call. trim() gives fully free slabs and
// cached dedicated blocks back to the driver (cudaFreeHost). Every block is 4096-byte aligned.
//
// Budget. Page-locked bytes (slabs + dedicated blocks + registered memory) never exceed the
// budget: by default half of physical RAM; RAMSTREAM_PIN_BUDGET (read once, at first use:
// "8G", "512M", "1073741824", "60%") or set_budget() override it.
//
// Fallback. Without a CUDA build, driver or GPU, when the budget would be exceeded or when
// cudaHostAlloc fails, a block comes from std::aligned_alloc(4096) instead. It is counted
// (fallback_allocations, fallback_bytes_in_use) and the last reason is kept (fallback_reason).
//
// Streams: the arena knows none. A released block may be handed out again at once, so the caller
// must make sure no asynchronous copy still reads or writes it (wait for the copy's event first);
// unlike torch's pin_memory() allocator nothing is recorded on streams.
//
// Thread-safety: every member function may be called from any thread concurrently; none needs
// the Python GIL. Driver calls (pinning, unpinning, registering) run outside the arena's lock.
// release() never calls the driver. cudaFreeHost synchronises the device: it runs in trim(),
// set_budget() and, under budget pressure only, in allocate()/register_memory() when unpinning
// cached blocks makes room for the request.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ramstream/status.h"

namespace ramstream {

// A snapshot of the arena's counters. Byte counts of blocks are their rounded (class) sizes.
struct HostMemoryStats {
  std::uint64_t bytes_pinned = 0;          // page-locked bytes held from the driver (slabs + dedicated)
  std::uint64_t bytes_in_use = 0;          // bytes of blocks handed out now (pinned + fallback)
  std::uint64_t bytes_requested = 0;       // bytes callers asked for, of the blocks in use
  std::uint64_t bytes_cached = 0;          // pinned bytes not in use (free blocks, slab tails)
  std::uint64_t peak_bytes_in_use = 0;     // max of bytes_in_use since start or reset_peak()
  std::uint64_t bytes_registered = 0;      // existing memory page-locked by register_memory()
  std::uint64_t fallback_allocations = 0;  // allocations served by ordinary memory (cumulative)
  std::uint64_t fallback_bytes_in_use = 0; // part of bytes_in_use that is ordinary memory
  std::uint64_t pin_calls = 0;             // cudaHostAlloc calls made (reuse does not add any)
  std::uint64_t unpin_calls = 0;           // cudaFreeHost calls made (trim)
  std::uint64_t budget = 0;                // page-lock budget in bytes
  std::uint64_t allocations = 0;           // successful allocate() calls (cumulative)
  std::uint64_t reuse_hits = 0;            // allocations served from a cached pinned block
  std::uint64_t slabs = 0;                 // slabs held
  std::uint64_t dedicated_blocks = 0;      // dedicated pinned blocks held (in use + cached)
  std::uint64_t physical_memory = 0;       // physical RAM in bytes (the default budget's base)
  bool pinning_available = false;          // a CUDA build with a driver and at least one GPU
  std::string fallback_reason;             // why the last fallback happened ("" if none yet)
  std::string budget_source;               // "default", "RAMSTREAM_PIN_BUDGET=..." or "set_budget"
  std::string budget_error;                // a bad RAMSTREAM_PIN_BUDGET value, or ""
};

// The page-locking calls the arena makes, as plain function pointers so that tests can run the
// arena's pinned path on a machine without a GPU. Called without the arena's lock, possibly from
// several threads at once. `device` is the arena's set_device() value (-1: leave it alone).
struct PinDriver {
  // "" when page-locking can be used, otherwise why not (asked once, at first need).
  std::string (*availability)();
  Status (*pin)(int device, std::size_t bytes, void** out);  // page-locked, Portable|Mapped
  void (*unpin)(int device, void* ptr);                       // its release
  Status (*register_range)(int device, void* ptr, std::size_t bytes);  // cudaHostRegister
  Status (*unregister_range)(int device, void* ptr);                    // cudaHostUnregister
  Status (*device_pointer)(int device, void* host, void** dev);         // cudaHostGetDevicePointer
};

// The CUDA runtime's calls (statically linked); without a CUDA build, a driver that is never
// available.
const PinDriver& cuda_pin_driver();

class HostArena {
 public:
  static constexpr std::size_t kAlignment = 4096;
  static constexpr std::size_t kMinBlock = 4096;
  static constexpr std::size_t kSlabBytes = std::size_t{64} << 20;
  static constexpr std::size_t kMaxSlabBlock = std::size_t{16} << 20;  // larger: dedicated
  static constexpr std::size_t kDedicatedGranule = std::size_t{2} << 20;
  static constexpr double kDefaultBudgetFraction = 0.5;

  // Reads RAMSTREAM_PIN_BUDGET; touches no driver (that happens on the first allocation).
  explicit HostArena(const PinDriver& driver = cuda_pin_driver());
  // Unpins everything it holds; blocks still in use become dangling. The process-wide arena is
  // never destroyed (tensors may outlive interpreter shutdown).
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // A block of at least `bytes` bytes (0 is allowed and gives a minimal block), 4096-aligned.
  // *pinned (optional) tells whether it is page-locked or a fallback. kOutOfMemory, with the
  // arithmetic, when neither page-locked nor ordinary memory can be had. `own_pages`: the block
  // is a dedicated allocation rounded to 4096 bytes whatever its size, sharing no slab with other
  // blocks, so that trim() gives it back to the driver as soon as it is released (for pools whose
  // size follows the batch: a slab keeps all of its 64 MiB pinned while any block in it lives).
  Status allocate(std::size_t bytes, void** out, bool* pinned = nullptr, bool own_pages = false);
  // Returns a block from allocate() to the arena (nullptr: no-op). kInvalidArgument for a
  // pointer the arena did not hand out (or already got back).
  Status release(void* ptr);
  // Unpins fully free slabs and cached dedicated blocks (cudaFreeHost; synchronises the device).
  Status trim();
  // Sets the page-lock budget; cached blocks are unpinned until the arena fits in it when it
  // can. Pinned blocks in use are never taken back: later requests fall back instead.
  Status set_budget(std::uint64_t bytes);
  std::uint64_t budget() const;

  // Page-locks existing memory [ptr, ptr + bytes) (cudaHostRegister, Portable | Mapped) within
  // the budget. kUnsupported without a driver/GPU, kOutOfMemory over budget, kCudaError when the
  // driver refuses (e.g. overlapping an already registered range).
  Status register_memory(void* ptr, std::size_t bytes);
  // Undoes register_memory(ptr, ...); kInvalidArgument if ptr was not registered here.
  Status unregister_memory(void* ptr);
  // The device address of mapped page-locked host memory (cudaHostGetDevicePointer), for kernels
  // that read host memory directly. kUnsupported without a driver, kCudaError if not mapped.
  Status device_pointer(void* host, void** dev);
  // The GPU whose context page-locking calls use (cudaSetDevice on the calling thread before
  // each driver call); -1 (default) leaves the runtime's current device (0) alone. Set it to
  // the device the process trains on, so that pinning creates no context on GPU 0 of a rank
  // that uses another GPU. Memory stays Portable: usable from every device.
  Status set_device(int device);

  // True when `ptr` lies in memory the arena page-locked (slab, dedicated block or registration).
  bool is_pinned(const void* ptr) const;
  HostMemoryStats stats() const;
  void reset_peak();

 private:
  enum class Kind : std::uint8_t { kSlab, kDedicated, kFallback };
  struct Slab {
    char* base = nullptr;
    std::size_t bytes = 0;
    std::size_t used = 0;       // bump offset: [0, used) is carved into blocks
    std::size_t live = 0;       // carved blocks currently handed out
  };
  struct Block {
    std::size_t bytes = 0;      // rounded size
    std::size_t requested = 0;
    Kind kind = Kind::kFallback;
    Slab* slab = nullptr;
  };
  struct FreeBlock {
    void* ptr;
    Slab* slab;
  };

  bool pinning_available_locked() const;
  // Bytes unpin_cached_locked() could give back: cached dedicated blocks and fully free slabs.
  std::uint64_t unpinnable_locked() const;
  // Unpins cached memory (dedicated blocks first, largest first, then fully free slabs) until at
  // least `amount` bytes went back or nothing cached is left. Driver calls run unlocked.
  void unpin_cached_locked(std::unique_lock<std::mutex>& lock, std::uint64_t amount);
  // Whether `need` more page-locked bytes fit in the budget, unpinning cached memory if that
  // makes them fit (and only then).
  bool make_room_locked(std::unique_lock<std::mutex>& lock, std::uint64_t need);
  std::uint64_t headroom_locked() const {
    const std::uint64_t t = locked_total_locked();
    return budget_ > t ? budget_ - t : 0;
  }
  std::uint64_t locked_total_locked() const { return pinned_ + registered_ + reserved_; }
  void* carve_locked(Slab* slab, std::size_t cls);
  void account_alloc_locked(void* p, const Block& b);
  // Serves a request from std::aligned_alloc, counted as a fallback with `reason`.
  Status fallback_locked(std::size_t bytes, const std::string& reason, void** out);

  const PinDriver driver_;
  mutable std::mutex mu_;
  int device_ = -1;
  mutable int pinning_state_ = -1;  // -1 unknown, 0 no, 1 yes (decided at first need)
  mutable std::string no_pinning_reason_;
  std::uint64_t budget_ = 0;
  std::uint64_t physical_ = 0;
  std::string budget_source_;
  std::string budget_error_;

  std::vector<std::unique_ptr<Slab>> slabs_;
  std::size_t current_slab_ = 0;                            // hint: slab with a usable tail
  std::map<std::size_t, std::vector<FreeBlock>> free_;      // class bytes -> cached blocks
  std::multimap<std::size_t, void*> free_dedicated_;        // bytes -> cached dedicated block
  std::unordered_map<void*, Block> live_;                   // blocks handed out
  std::map<std::uintptr_t, std::size_t> pinned_ranges_;     // base -> bytes: slabs, dedicated
  std::map<std::uintptr_t, std::size_t> registered_ranges_; // base -> bytes

  std::uint64_t pinned_ = 0, registered_ = 0, reserved_ = 0;
  std::uint64_t in_use_ = 0, requested_ = 0, peak_ = 0, fallback_in_use_ = 0;
  std::uint64_t fallback_count_ = 0, pin_calls_ = 0, unpin_calls_ = 0, allocations_ = 0,
                reuse_hits_ = 0, dedicated_count_ = 0;
  std::string fallback_reason_;
};

// The process-wide arena (created on first use, never destroyed).
HostArena& global_arena();

// Rounded size of a slab block for a request of `bytes` (<= kMaxSlabBlock): the smallest
// 2^k * {1, 1.25, 1.5, 1.75} that holds it, rounded up to 4096, at least 4096.
std::size_t host_size_class(std::size_t bytes);

// Parses a byte count: "1048576", "512K", "1.5G", "2TiB", "64MB" (K/M/G/T are powers of 1024,
// case-insensitive, optional "B"/"iB"), or a percentage of `physical` ("60%", 0-100).
// kInvalidArgument with an explanation for anything else.
Status parse_byte_size(const std::string& text, std::uint64_t physical, std::uint64_t* out);

// Physical RAM of this machine in bytes (sysconf), 0 if unknown.
std::uint64_t physical_memory_bytes();

}  // namespace ramstream
