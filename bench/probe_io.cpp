// Direct I/O on one disk, two ways (issue 29: "O_DIRECT with pread/pwrite, or io_uring where the
// kernel has it: measure which"): the disk store's way (threads, each a blocking pread/pwrite of
// one chunk at a time) and io_uring (one thread, a queue of `depth` chunks in flight), on the
// same O_DIRECT file, for each chunk size and concurrency asked. Standalone (no liburing: the
// ring is set up with the raw system calls), built by bench/gpu_run.sh's `io` stage:
//
//   g++ -O2 -std=c++17 -pthread bench/probe_io.cpp -o /tmp/probe_io
//   /tmp/probe_io DIR [GIB=2] [CHUNKS_MIB=1,8] [CONCURRENCY=1,4,16]
//
// One JSON line per (method, op, chunk, concurrency): GB/s over the whole file (GIB rounded down to
// a multiple of 32 MiB and of the largest chunk; chunks are powers of two). The file is
// created exclusive with mode 0600 and removed at the end (also when a measurement fails).
#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::vector<size_t> parse_list(const char* s) {
  std::vector<size_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoull(p, &end, 10));
    p = (*end == ',') ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

void* aligned_buffer(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) return nullptr;
  // not zeros: a virtual disk may shortcut zero pages
  for (size_t i = 0; i < bytes; i += 8) *reinterpret_cast<uint64_t*>(static_cast<char*>(p) + i) = i * 0x9E3779B97F4A7C15ull;
  return p;
}

// The store's way: `threads` threads take chunks in turn, each one blocking pread/pwrite.
bool run_threads(int fd, bool write, size_t file, size_t chunk, size_t threads) {
  std::atomic<size_t> next{0};
  std::atomic<bool> ok{true};
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      void* buf = aligned_buffer(chunk);
      if (!buf) { ok = false; return; }
      for (size_t off; (off = next.fetch_add(chunk)) < file;) {
        ssize_t n = write ? pwrite(fd, buf, chunk, off) : pread(fd, buf, chunk, off);
        if (n != static_cast<ssize_t>(chunk)) { ok = false; break; }
      }
      std::free(buf);
    });
  for (auto& th : pool) th.join();
  return ok;
}

struct Ring {
  int fd = -1;
  unsigned *sq_tail = nullptr, *sq_mask = nullptr, *sq_array = nullptr;
  unsigned *cq_head = nullptr, *cq_tail = nullptr, *cq_mask = nullptr;
  io_uring_sqe* sqes = nullptr;
  io_uring_cqe* cqes = nullptr;
};

bool ring_init(Ring& r, unsigned entries) {
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  r.fd = static_cast<int>(syscall(__NR_io_uring_setup, entries, &p));
  if (r.fd < 0) return false;
  size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) sq_bytes = cq_bytes = sq_bytes > cq_bytes ? sq_bytes : cq_bytes;
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_SHARED | MAP_POPULATE;
  char* sq = static_cast<char*>(mmap(nullptr, sq_bytes, prot, flags, r.fd, IORING_OFF_SQ_RING));
  char* cq = single ? sq : static_cast<char*>(mmap(nullptr, cq_bytes, prot, flags, r.fd, IORING_OFF_CQ_RING));
  void* sqes = mmap(nullptr, p.sq_entries * sizeof(io_uring_sqe), prot, flags, r.fd, IORING_OFF_SQES);
  if (sq == MAP_FAILED || cq == MAP_FAILED || sqes == MAP_FAILED) return false;
  r.sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  r.sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  r.sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  r.cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  r.cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  r.cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  r.cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  r.sqes = static_cast<io_uring_sqe*>(sqes);
  return true;  // the mappings live until the process exits (a probe)
}

void ring_push(Ring& r, bool write, int fd, void* buf, size_t chunk, size_t off, unsigned slot) {
  const unsigned tail = *r.sq_tail, idx = tail & *r.sq_mask;
  io_uring_sqe* e = &r.sqes[idx];
  std::memset(e, 0, sizeof *e);
  e->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
  e->fd = fd;
  e->addr = reinterpret_cast<uint64_t>(buf);
  e->len = static_cast<unsigned>(chunk);
  e->off = off;
  e->user_data = slot;
  r.sq_array[idx] = idx;
  __atomic_store_n(r.sq_tail, tail + 1, __ATOMIC_RELEASE);
}

// io_uring: one thread keeps `depth` chunks in flight, one buffer each.
bool run_uring(int fd, bool write, size_t file, size_t chunk, size_t depth) {
  Ring r;
  if (!ring_init(r, static_cast<unsigned>(depth))) return false;
  std::vector<void*> bufs(depth);
  for (auto& b : bufs)
    if (!(b = aligned_buffer(chunk))) return false;
  size_t off = 0, inflight = 0;
  bool ok = true;
  unsigned to_submit = 0;
  for (unsigned s = 0; s < depth && off < file; ++s, off += chunk, ++inflight, ++to_submit)
    ring_push(r, write, fd, bufs[s], chunk, off, s);
  while (inflight > 0) {
    if (syscall(__NR_io_uring_enter, r.fd, to_submit, 1, IORING_ENTER_GETEVENTS, nullptr, 0) < 0) { ok = false; break; }
    to_submit = 0;
    unsigned head = *r.cq_head;
    const unsigned tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) {
      const io_uring_cqe& c = r.cqes[head & *r.cq_mask];
      --inflight;
      if (c.res != static_cast<int>(chunk)) ok = false;
      if (ok && off < file) {
        ring_push(r, write, fd, bufs[c.user_data], chunk, off, static_cast<unsigned>(c.user_data));
        off += chunk, ++inflight, ++to_submit;
      }
    }
    __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
  }
  for (void* b : bufs) std::free(b);
  close(r.fd);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [GIB=2] [CHUNKS_MIB=1,8] [CONCURRENCY=1,4,16]\n", argv[0]);
    return 2;
  }
  size_t file = static_cast<size_t>(std::atof(argc > 2 ? argv[2] : "2") * (1 << 30));
  const auto chunks = parse_list(argc > 3 ? argv[3] : "1,8");
  const auto conc = parse_list(argc > 4 ? argv[4] : "1,4,16");
  size_t largest = 0;
  for (size_t mib : chunks) largest = mib > largest ? mib : largest;
  bool bad = chunks.empty() || conc.empty();
  for (size_t mib : chunks) bad = bad || mib < 1 || mib > 1024 || (mib & (mib - 1)) != 0;
  for (size_t c : conc) bad = bad || c < 1 || c > 256;
  const size_t step = std::max(size_t(32) << 20, largest << 20);  // every chunk divides the file
  file = file / step * step;
  if (bad || file == 0) {
    std::fprintf(stderr,
                 "probe_io: CHUNKS_MIB must be powers of two in 1..1024, CONCURRENCY integers in 1..256, "
                 "and GIB at least 32 MiB and the largest chunk (got GIB %s, CHUNKS_MIB %s, CONCURRENCY %s)\n",
                 argc > 2 ? argv[2] : "2", argc > 3 ? argv[3] : "1,8", argc > 4 ? argv[4] : "1,4,16");
    return 2;
  }
  const std::string path = std::string(argv[1]) + "/ramstream-probe-io." + std::to_string(getpid());
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "probe_io: cannot open %s with O_DIRECT: %s\n", path.c_str(), std::strerror(errno));
    return 1;
  }
  int rc = 0;
  if (posix_fallocate(fd, 0, static_cast<off_t>(file)) != 0) rc = 1;
  // write first (the reads then read written blocks, not holes), then read, per configuration
  for (size_t mib : chunks)
    for (size_t c : conc)
      for (const char* method : {"pread_threads", "io_uring"})
        for (bool write : {true, false}) {
          if (rc) break;
          const size_t chunk = mib << 20;
          const double t0 = now();
          const bool ok = std::strcmp(method, "io_uring") == 0 ? run_uring(fd, write, file, chunk, c)
                                                                 : run_threads(fd, write, file, chunk, c);
          if (write) fdatasync(fd);
          const double s = now() - t0;
          std::printf("{\"method\": \"%s\", \"op\": \"%s\", \"chunk_mib\": %zu, \"concurrency\": %zu, "
                      "\"bytes\": %zu, \"seconds\": %.4f, \"gbps\": %.3f, \"ok\": %s}\n",
                      method, write ? "write" : "read", mib, c, file, s, ok ? file / s / 1e9 : 0.0,
                      ok ? "true" : "false");
          std::fflush(stdout);
        }
  close(fd);
  unlink(path.c_str());
  return rc;
}
