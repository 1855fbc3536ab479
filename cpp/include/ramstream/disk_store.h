// DiskStore: fixed-size records in one scratch file under a directory, read into and written from
// aligned host buffers asynchronously on the store's own I/O threads (the disk tier's mechanism).
//
// File. One file per store, created with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, under a unique
// name ("ramstream-<pid>-<random>.store", or the name given). By default it is unlinked right after
// it is opened and checked, so that a crash or a kill never leaves it behind (the space returns when
// the descriptor closes); with unlink_on_open = false the name stays visible until close(). The file
// is scratch space for one process: nothing is fsync'ed and it is never a checkpoint.
//
// Layout. Record i is the extent [offset(i), offset(i) + capacity(i)) of the file, capacity(i) =
// record_bytes(i) rounded up to alignment(); extents do not overlap. alignment() is 4096 or the
// filesystem's direct-I/O alignment when larger (statx STATX_DIOALIGN, else fstatvfs's block size).
// With preallocate (the default) the whole file is reserved at open (fallocate), so a full disk or
// a file-size limit is an error of open(), never of a later write (except on filesystems that cannot
// reserve space: then writes may still fail). A record never written reads as zeros.
//
// I/O mode. O_DIRECT when the filesystem takes it (checked with one aligned write and read at
// open); otherwise buffered I/O (tmpfs before Linux 6.6, some FUSE filesystems), where writes
// start writeback at once and posix_fadvise(DONTNEED) drops the chunk from the page cache when it
// can. direct() says which mode is in use.
//
// Requests. read()/write() queue one request and return a ticket at once; wait(ticket) returns
// its Status. A request is split into chunks of chunk_bytes, run by io_threads threads together
// (pread/pwrite, retried on short transfers and EINTR); the record's unaligned tail goes through a
// small aligned bounce block, so buffers need only record_bytes(i) bytes. Buffers must start at a
// multiple of alignment() (arena blocks do) and stay alive and untouched until wait() returns.
// Errors (ENOSPC, EFBIG, EIO, a short write) come back from wait() as kIoError with errno() and
// the path, record and offset; nothing throws or exits.
//
// Guarantees. Records are independent: a failed write changes no other record. A failed write
// leaves its own record's content undefined (part old, part new); the store marks it and a read
// of it fails (kIoError, EIO) until a write of it succeeds. Nothing is lost as long as the caller
// keeps its source buffer until wait() of the write returned ok. A record may have either several
// reads or one write in flight, not both: a conflicting request is refused (kInvalidArgument).
//
// Thread-safety: every member function may be called from any thread; none needs the Python GIL.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ramstream/status.h"

namespace ramstream {

struct DiskStoreOptions {
  std::size_t chunk_bytes = std::size_t{8} << 20;  // request split size (a multiple of alignment)
  int io_threads = 4;                              // chunks in flight at once (1..64)
  bool unlink_on_open = true;   // remove the name at once (a crash leaves nothing)
  bool preallocate = true;      // reserve the whole file at open (fallocate)
  int direct = -1;              // -1: O_DIRECT when the filesystem takes it; 0: never; 1: required
  std::string file_name;        // "": a unique name; else this name (EEXIST if it exists)
};

// Counters since open. *_seconds: wall time during which at least one request of that kind was
// queued or running (so bytes / seconds is the achieved rate).
struct DiskStoreStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t reads = 0;        // read requests completed (ok or not)
  std::uint64_t writes = 0;       // write requests completed (ok or not)
  std::uint64_t errors = 0;       // requests that failed
  double read_seconds = 0.0;
  double write_seconds = 0.0;
};

class DiskStore {
 public:
  using Ticket = std::uint64_t;

  // Creates the store's file under `directory` for records of the given sizes (0 allowed).
  // kIoError (errno, the path) when the directory is missing, not writable or the space cannot
  // be reserved; kInvalidArgument for bad options.
  static Status open(const std::string& directory, const std::vector<std::uint64_t>& record_bytes,
                     const DiskStoreOptions& options, std::unique_ptr<DiskStore>* out);
  // close(), ignoring its Status.
  ~DiskStore();
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  // Queues a read of record `record` into dst (bytes must equal record_bytes(record); dst aligned
  // to alignment()). kInvalidArgument for a bad record, size or alignment, a write in flight on
  // the record, or a closed store.
  Status read(std::size_t record, void* dst, std::uint64_t bytes, Ticket* ticket);
  // Queues a write of record `record` from src (same rules; no other request in flight on it).
  Status write(std::size_t record, const void* src, std::uint64_t bytes, Ticket* ticket);
  // Blocks until the request ended; its Status. Each ticket is waited once (then unknown).
  Status wait(Ticket ticket);
  // True when the request ended (wait() will not block); false for an unknown ticket.
  bool done(Ticket ticket);
  // Forgets a ticket that will not be waited: its request still runs to the end.
  void discard(Ticket ticket);
  // Waits for every request, stops the threads, closes the file and removes its name. Idempotent.
  Status close();

  bool is_open() const;
  bool direct() const { return direct_; }
  std::size_t alignment() const { return alignment_; }
  const std::string& path() const { return path_; }
  bool unlinked() const;
  std::size_t num_records() const { return record_bytes_.size(); }
  std::uint64_t record_bytes(std::size_t i) const { return record_bytes_[i]; }
  std::uint64_t record_offset(std::size_t i) const { return offsets_[i]; }
  std::uint64_t file_bytes() const { return file_bytes_; }
  DiskStoreStats stats() const;

 private:
  struct Request;
  struct Chunk {
    std::shared_ptr<Request> req;
    std::uint64_t begin = 0;  // byte range of the record, [begin, end)
    std::uint64_t end = 0;
  };

  DiskStore() = default;
  Status submit(bool is_write, std::size_t record, void* buf, std::uint64_t bytes, Ticket* ticket);
  void io_loop();
  Status run_chunk(const Chunk& c, unsigned char* bounce);
  void finish_chunk(const Chunk& c, const Status& s);

  int fd_ = -1;
  bool direct_ = false;
  std::size_t alignment_ = 4096;
  std::size_t chunk_bytes_ = 0;
  std::string path_;
  std::vector<std::uint64_t> record_bytes_;
  std::vector<std::uint64_t> offsets_;
  std::uint64_t file_bytes_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // chunks queued, or stopping
  std::condition_variable done_cv_;  // a request ended
  std::deque<Chunk> queue_;
  std::vector<std::thread> threads_;
  std::unordered_map<Ticket, std::shared_ptr<Request>> requests_;
  std::vector<int> reads_in_flight_;    // per record
  std::vector<char> write_in_flight_;   // per record
  std::vector<char> torn_;              // per record: its last write failed
  Ticket next_ticket_ = 1;
  int in_flight_[2] = {0, 0};           // requests of each kind (0 read, 1 write) not ended
  double busy_since_[2] = {0.0, 0.0};
  bool stopping_ = false;
  bool closed_ = false;
  bool name_removed_ = false;
  DiskStoreStats stats_;
};

// errno's symbolic name ("ENOSPC"), or "errno <n>".
std::string errno_name(int err);

}  // namespace ramstream
