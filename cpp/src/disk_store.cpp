// DiskStore: the scratch file (exclusive creation, alignment, reservation, O_DIRECT probe) and the
// I/O threads that run requests chunk by chunk with pread/pwrite.
#include "ramstream/disk_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>

namespace ramstream {

namespace {

constexpr std::size_t kMinAlignment = 4096;
constexpr std::size_t kMaxAlignment = std::size_t{1} << 16;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool is_pow2(std::uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

Status io_error(int err, const std::string& what) {
  return Status::io(err, what + ": " + std::strerror(err) + " (" + errno_name(err) + ")");
}

// The filesystem's direct-I/O alignment, at least 4096: statx's where the kernel reports it,
// else the block size fstatvfs gives when it is a sane power of two.
std::size_t file_alignment(int fd) {
  std::size_t a = kMinAlignment;
#if defined(STATX_DIOALIGN)
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    a = std::max<std::size_t>(a, sx.stx_dio_offset_align);
    a = std::max<std::size_t>(a, sx.stx_dio_mem_align);
    return is_pow2(a) && a <= kMaxAlignment ? a : kMinAlignment;
  }
#endif
  struct statvfs vfs;
  if (fstatvfs(fd, &vfs) == 0 && is_pow2(vfs.f_bsize) && vfs.f_bsize <= kMaxAlignment)
    a = std::max<std::size_t>(a, vfs.f_bsize);
  return a;
}

std::string unique_name(int attempt) {
  static std::mutex m;
  static std::mt19937_64 rng{std::random_device{}() ^
                             static_cast<std::uint64_t>(now_seconds() * 1e9)};
  std::uint64_t r;
  {
    std::lock_guard<std::mutex> lock(m);
    r = rng() + static_cast<std::uint64_t>(attempt);
  }
  char buf[80];
  std::snprintf(buf, sizeof buf, "ramstream-%ld-%016llx.store", static_cast<long>(getpid()),
                static_cast<unsigned long long>(r));
  return buf;
}

// pwrite/pread of [p, p + n) at `off`, whole: retried on EINTR and short transfers. A read that
// meets the end of the file fills the rest with zeros (a record never written).
Status transfer_all(bool is_write, int fd, unsigned char* p, std::uint64_t n, std::uint64_t off,
                    const std::string& where) {
  std::uint64_t done = 0;
  while (done < n) {
    const ssize_t r = is_write ? ::pwrite(fd, p + done, n - done, static_cast<off_t>(off + done))
                               : ::pread(fd, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error(errno, where + " at file offset " + std::to_string(off + done));
    }
    if (r == 0) {
      if (!is_write) {
        std::memset(p + done, 0, n - done);
        return Status::ok();
      }
      return io_error(EIO, where + ": short write, " + std::to_string(done) + " of " +
                               std::to_string(n) + " bytes at file offset " + std::to_string(off));
    }
    done += static_cast<std::uint64_t>(r);
  }
  return Status::ok();
}

}  // namespace

std::string errno_name(int err) {
  switch (err) {
    case ENOSPC: return "ENOSPC";
    case EFBIG: return "EFBIG";
    case EIO: return "EIO";
    case EDQUOT: return "EDQUOT";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case ENOTDIR: return "ENOTDIR";
    case EROFS: return "EROFS";
    case EEXIST: return "EEXIST";
    case EINVAL: return "EINVAL";
    case EINTR: return "EINTR";
    case ENOMEM: return "ENOMEM";
    case EMFILE: return "EMFILE";
    case ENFILE: return "ENFILE";
    case ENAMETOOLONG: return "ENAMETOOLONG";
    case ELOOP: return "ELOOP";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    case EBADF: return "EBADF";
    default: return "errno " + std::to_string(err);
  }
}

struct DiskStore::Request {
  bool is_write = false;
  std::size_t record = 0;
  unsigned char* buf = nullptr;
  std::uint64_t bytes = 0;
  Ticket ticket = 0;
  int remaining = 0;  // chunks not finished
  bool ended = false;
  bool discarded = false;
  Status status;
};

Status DiskStore::open(const std::string& directory, const std::vector<std::uint64_t>& record_bytes,
                       const DiskStoreOptions& o, std::unique_ptr<DiskStore>* out) {
  if (out == nullptr) return Status::invalid("DiskStore::open: out is null");
  if (o.io_threads < 1 || o.io_threads > 64)
    return Status::invalid("DiskStore: io_threads must be 1..64, got " + std::to_string(o.io_threads));
  if (o.direct < -1 || o.direct > 1)
    return Status::invalid("DiskStore: direct must be -1 (auto), 0 or 1, got " + std::to_string(o.direct));
  if (o.file_name.find('/') != std::string::npos || o.file_name == "." || o.file_name == "..")
    return Status::invalid("DiskStore: file_name must be a plain name, got '" + o.file_name + "'");
  if (directory.empty()) return Status::invalid("DiskStore: the directory is empty");

  struct stat st;
  if (::stat(directory.c_str(), &st) != 0)
    return io_error(errno, "disk store directory '" + directory + "'");
  if (!S_ISDIR(st.st_mode)) return io_error(ENOTDIR, "disk store directory '" + directory + "'");

  std::unique_ptr<DiskStore> s(new DiskStore());
  const std::string dir = directory.back() == '/' ? directory : directory + "/";
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  for (int attempt = 0; s->fd_ < 0; ++attempt) {
    const std::string path = dir + (o.file_name.empty() ? unique_name(attempt) : o.file_name);
    s->fd_ = ::open(path.c_str(), flags, 0600);
    if (s->fd_ >= 0) {
      s->path_ = path;  // ours: close() removes it (never a name this call did not create)
      break;
    }
    const int err = errno;
    if (err == EEXIST && o.file_name.empty() && attempt < 64) continue;
    return io_error(err, "cannot create the disk store file '" + path + "'");
  }
  s->closed_ = false;
  // From here the destructor (close) removes the file on any error.
  if (::fchmod(s->fd_, 0600) != 0) return io_error(errno, "fchmod '" + s->path_ + "'");

  s->alignment_ = file_alignment(s->fd_);
  const std::size_t a = s->alignment_;
  if (o.chunk_bytes == 0 || o.chunk_bytes % a != 0)
    return Status::invalid("DiskStore: chunk_bytes must be a positive multiple of the alignment (" +
                           std::to_string(a) + "), got " + std::to_string(o.chunk_bytes));
  s->chunk_bytes_ = o.chunk_bytes;
  s->record_bytes_ = record_bytes;
  std::uint64_t off = 0;
  for (std::uint64_t b : record_bytes) {
    if (b > (std::uint64_t{1} << 62))
      return Status::invalid("DiskStore: a record of " + std::to_string(b) + " bytes is too large");
    s->offsets_.push_back(off);
    off += round_up(b, a);
  }
  s->file_bytes_ = off;
  s->reads_in_flight_.assign(record_bytes.size(), 0);
  s->write_in_flight_.assign(record_bytes.size(), 0);
  s->torn_.assign(record_bytes.size(), 0);

  if (o.preallocate && off > 0) {
    if (::fallocate(s->fd_, 0, 0, static_cast<off_t>(off)) != 0) {
      const int err = errno;
      if (err != EOPNOTSUPP && err != ENOSYS)
        return io_error(err, "cannot reserve " + std::to_string(off) + " bytes for the disk store '" +
                                 s->path_ + "'");
      if (::ftruncate(s->fd_, static_cast<off_t>(off)) != 0)
        return io_error(errno, "cannot size the disk store '" + s->path_ + "' to " +
                                   std::to_string(off) + " bytes");
    }
  }

  // O_DIRECT when asked or possible, confirmed by one aligned write and read of zeros at offset 0
  // (the first record's first block, which reads as zeros until written anyway).
  if (o.direct != 0) {
    const int fl = ::fcntl(s->fd_, F_GETFL);
    bool ok = fl >= 0 && ::fcntl(s->fd_, F_SETFL, fl | O_DIRECT) == 0;
    if (ok && off > 0) {
      void* blk = std::aligned_alloc(a, a);
      if (blk == nullptr) return Status::oom("DiskStore: an aligned block of " + std::to_string(a));
      std::memset(blk, 0, a);
      const ssize_t w = ::pwrite(s->fd_, blk, a, 0);
      const int werr = errno;
      const ssize_t r = w == static_cast<ssize_t>(a) ? ::pread(s->fd_, blk, a, 0) : -1;
      std::free(blk);
      if (w < 0 && werr != EINVAL)
        return io_error(werr, "cannot write the disk store '" + s->path_ + "'");
      ok = w == static_cast<ssize_t>(a) && r == static_cast<ssize_t>(a);
      if (!ok) (void)::fcntl(s->fd_, F_SETFL, fl);
    }
    if (!ok && o.direct == 1)
      return Status::unsupported("DiskStore: direct=1 but the filesystem of '" + directory +
                                 "' refuses O_DIRECT");
    s->direct_ = ok;
  }
  if (!s->direct_) (void)::posix_fadvise(s->fd_, 0, 0, POSIX_FADV_SEQUENTIAL);

  if (o.unlink_on_open) {
    if (::unlink(s->path_.c_str()) != 0) return io_error(errno, "cannot unlink '" + s->path_ + "'");
    s->name_removed_ = true;
  }
  for (int t = 0; t < o.io_threads; ++t) s->threads_.emplace_back([p = s.get()] { p->io_loop(); });
  *out = std::move(s);
  return Status::ok();
}

DiskStore::~DiskStore() { (void)close(); }

bool DiskStore::is_open() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !closed_ && !stopping_;
}

bool DiskStore::unlinked() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return name_removed_;
}

Status DiskStore::close() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (closed_) return Status::ok();
    if (stopping_) {  // another thread is closing: wait for it to finish
      done_cv_.wait(lock, [&] { return closed_; });
      return Status::ok();
    }
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();  // they drain the queue first
  threads_.clear();
  Status s;
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ >= 0 && ::close(fd_) != 0) s = io_error(errno, "close '" + path_ + "'");
  fd_ = -1;
  if (!name_removed_ && !path_.empty()) {
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT && s.is_ok())
      s = io_error(errno, "cannot remove '" + path_ + "'");
    name_removed_ = true;
  }
  closed_ = true;
  done_cv_.notify_all();
  return s;
}

Status DiskStore::read(std::size_t record, void* dst, std::uint64_t bytes, Ticket* ticket) {
  return submit(false, record, dst, bytes, ticket);
}

Status DiskStore::write(std::size_t record, const void* src, std::uint64_t bytes, Ticket* ticket) {
  return submit(true, record, const_cast<void*>(src), bytes, ticket);
}

Status DiskStore::submit(bool is_write, std::size_t record, void* buf, std::uint64_t bytes,
                         Ticket* ticket) {
  const char* op = is_write ? "write" : "read";
  if (ticket == nullptr) return Status::invalid("DiskStore: ticket is null");
  if (record >= record_bytes_.size())
    return Status::invalid(std::string("DiskStore.") + op + ": record " + std::to_string(record) +
                           " out of range (the store has " + std::to_string(record_bytes_.size()) +
                           " records)");
  if (bytes != record_bytes_[record])
    return Status::invalid(std::string("DiskStore.") + op + ": record " + std::to_string(record) +
                           " holds " + std::to_string(record_bytes_[record]) + " bytes, the buffer " +
                           std::to_string(bytes));
  if (bytes > 0 && (buf == nullptr || reinterpret_cast<std::uintptr_t>(buf) % alignment_ != 0))
    return Status::invalid(std::string("DiskStore.") + op + ": the buffer must be aligned to " +
                           std::to_string(alignment_) + " bytes (pinned arena blocks are), address " +
                           std::to_string(reinterpret_cast<std::uintptr_t>(buf)) + " is not");
  auto req = std::make_shared<Request>();
  req->is_write = is_write;
  req->record = record;
  req->buf = static_cast<unsigned char*>(buf);
  req->bytes = bytes;
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_ || closed_) return Status::invalid(std::string("DiskStore.") + op + ": the store is closed");
  if (write_in_flight_[record] || (is_write && reads_in_flight_[record] > 0))
    return Status::invalid(std::string("DiskStore.") + op + ": record " + std::to_string(record) +
                           " has a " + (write_in_flight_[record] ? "write" : "read") +
                           " in flight; wait for its ticket first");
  if (!is_write && torn_[record])
    return Status::io(EIO, "DiskStore.read: record " + std::to_string(record) + " of '" + path_ +
                               "' is undefined: its last write failed; write it again first");
  const Ticket t = next_ticket_++;
  req->ticket = t;
  requests_[t] = req;
  const int k = is_write ? 1 : 0;
  if (in_flight_[k]++ == 0) busy_since_[k] = now_seconds();
  if (is_write) write_in_flight_[record] = 1; else ++reads_in_flight_[record];
  *ticket = t;
  if (bytes == 0) {
    req->remaining = 1;
    lock.unlock();
    finish_chunk(Chunk{req, 0, 0}, Status::ok());
    return Status::ok();
  }
  for (std::uint64_t b = 0; b < bytes; b += chunk_bytes_) {
    queue_.push_back(Chunk{req, b, std::min<std::uint64_t>(bytes, b + chunk_bytes_)});
    ++req->remaining;
  }
  lock.unlock();
  work_cv_.notify_all();
  return Status::ok();
}

void DiskStore::io_loop() {
  void* bounce = std::aligned_alloc(alignment_, alignment_);
  for (;;) {
    Chunk c;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stopping and drained
      c = std::move(queue_.front());
      queue_.pop_front();
    }
    const Status s = bounce == nullptr
                         ? Status::oom("DiskStore: no aligned bounce block of " + std::to_string(alignment_))
                         : run_chunk(c, static_cast<unsigned char*>(bounce));
    finish_chunk(c, s);
  }
  std::free(bounce);
}

Status DiskStore::run_chunk(const Chunk& c, unsigned char* bounce) {
  const Request& r = *c.req;
  const std::uint64_t base = offsets_[r.record];
  const std::uint64_t whole = (c.end - c.begin) / alignment_ * alignment_;
  const std::uint64_t tail = c.end - c.begin - whole;
  const std::string where = std::string("disk store '") + path_ + "': " +
                            (r.is_write ? "write" : "read") + " of record " + std::to_string(r.record);
  RAMSTREAM_RETURN_IF_ERROR(transfer_all(r.is_write, fd_, r.buf + c.begin, whole, base + c.begin, where));
  if (tail > 0) {
    const std::uint64_t off = base + c.begin + whole;
    if (r.is_write) {
      std::memset(bounce, 0, alignment_);
      std::memcpy(bounce, r.buf + c.begin + whole, tail);
      RAMSTREAM_RETURN_IF_ERROR(transfer_all(true, fd_, bounce, alignment_, off, where));
    } else {
      RAMSTREAM_RETURN_IF_ERROR(transfer_all(false, fd_, bounce, alignment_, off, where));
      std::memcpy(r.buf + c.begin + whole, bounce, tail);
    }
  }
  if (r.is_write && !direct_) {
    // Buffered: start writeback now and drop what is already clean, so that the page cache does
    // not keep what was meant to leave RAM. A writeback error shows here when the kernel knows it.
    const off_t off = static_cast<off_t>(base + c.begin);
    const off_t len = static_cast<off_t>(round_up(c.end - c.begin, alignment_));
    if (::sync_file_range(fd_, off, len, SYNC_FILE_RANGE_WRITE) != 0 && (errno == EIO || errno == ENOSPC))
      return io_error(errno, where + " (writeback)");
    (void)::posix_fadvise(fd_, off, len, POSIX_FADV_DONTNEED);
  }
  return Status::ok();
}

void DiskStore::finish_chunk(const Chunk& c, const Status& s) {
  Request& r = *c.req;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!s.is_ok() && r.status.is_ok()) r.status = s;
    if (--r.remaining > 0) return;
    r.ended = true;
    const int k = r.is_write ? 1 : 0;
    if (--in_flight_[k] == 0) {
      (k ? stats_.write_seconds : stats_.read_seconds) += now_seconds() - busy_since_[k];
    }
    if (r.is_write) {
      write_in_flight_[r.record] = 0;
      torn_[r.record] = r.status.is_ok() ? 0 : 1;
      ++stats_.writes;
      if (r.status.is_ok()) stats_.bytes_written += r.bytes;
    } else {
      --reads_in_flight_[r.record];
      ++stats_.reads;
      if (r.status.is_ok()) stats_.bytes_read += r.bytes;
    }
    if (!r.status.is_ok()) ++stats_.errors;
    if (r.discarded) requests_.erase(r.ticket);
  }
  done_cv_.notify_all();
}

Status DiskStore::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(ticket);
  if (it == requests_.end() || it->second->discarded)
    return Status::invalid("DiskStore.wait: unknown ticket " + std::to_string(ticket) +
                           " (already waited or discarded)");
  std::shared_ptr<Request> r = it->second;
  done_cv_.wait(lock, [&] { return r->ended; });
  requests_.erase(ticket);
  return r->status;
}

bool DiskStore::done(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(ticket);
  return it != requests_.end() && it->second->ended;
}

void DiskStore::discard(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(ticket);
  if (it == requests_.end()) return;
  if (it->second->ended) requests_.erase(it);
  else it->second->discarded = true;
}

DiskStoreStats DiskStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  DiskStoreStats s = stats_;
  const double t = now_seconds();
  if (in_flight_[0] > 0) s.read_seconds += t - busy_since_[0];
  if (in_flight_[1] > 0) s.write_seconds += t - busy_since_[1];
  return s;
}

}  // namespace ramstream
