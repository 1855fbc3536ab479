// Unit tests of DiskStore (ctest): round trips over many odd-sized records with reads and writes
// interleaved (direct and buffered, one chunk and many), the file's creation (exclusive, 0600,
// removed), bad directories and buffers, and a file-size limit (RLIMIT_FSIZE) in a child process.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checks.h"
#include "ramstream/disk_store.h"

using namespace ramstream;

namespace {

struct Buf {  // a 4096-aligned buffer of n bytes
  explicit Buf(std::size_t n) : n(n), p(static_cast<unsigned char*>(std::aligned_alloc(4096, n / 4096 * 4096 + 4096))) {}
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  std::size_t n;
  unsigned char* p;
};

std::string make_dir(const char* base) {
  std::string t = std::string(base) + "/rs-disk-XXXXXX";
  char* d = mkdtemp(t.data());
  return d ? std::string(d) : std::string();
}

int count_files(const std::string& dir) {
  std::string cmd = "ls -A '" + dir + "' | wc -l";
  FILE* f = popen(cmd.c_str(), "r");
  int n = -1;
  if (f && std::fscanf(f, "%d", &n) != 1) n = -1;
  if (f) pclose(f);
  return n;
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

void fill(Buf& b, std::mt19937& rng) {
  for (std::size_t i = 0; i < b.n; ++i) b.p[i] = static_cast<unsigned char>(rng());
}

// Many odd records written, overwritten and read back with requests in flight together.
void test_round_trip(const std::string& dir, int direct, std::size_t chunk) {
  const std::vector<std::uint64_t> sizes = {1, 4095, 4096, 4097, 3 * 4096 + 7, 0, 100'003, 2'000'001, 12'345};
  DiskStoreOptions o;
  o.direct = direct;
  o.chunk_bytes = chunk;
  o.io_threads = 3;
  std::unique_ptr<DiskStore> s;
  CHECK_OK(DiskStore::open(dir, sizes, o, &s));
  if (!s) return;
  if (direct == 0) CHECK(!s->direct());
  CHECK(s->alignment() >= 4096 && s->alignment() % 4096 == 0);
  CHECK(s->file_bytes() % s->alignment() == 0);
  std::mt19937 rng(7 + direct);
  std::vector<std::unique_ptr<Buf>> src, dst;
  for (auto n : sizes) {
    src.push_back(std::make_unique<Buf>(n));
    dst.push_back(std::make_unique<Buf>(n));
    fill(*src.back(), rng);
  }
  std::uint64_t written = 0, read = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<DiskStore::Ticket> t(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {  // all writes in flight at once
      if (round > 0 && i % 2 == 0) fill(*src[i], rng);
      CHECK_OK(s->write(i, src[i]->p, sizes[i], &t[i]));
      written += sizes[i];
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) CHECK_OK(s->wait(t[i]));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::memset(dst[i]->p, 0xAB, sizes[i]);
      CHECK_OK(s->read(i, dst[i]->p, sizes[i], &t[i]));
      read += sizes[i];
    }
    for (std::size_t i = sizes.size(); i-- > 0;) {
      CHECK_OK(s->wait(t[i]));
      CHECK(std::memcmp(src[i]->p, dst[i]->p, sizes[i]) == 0);
    }
  }
  // A record never written reads as zeros; a read may be waited after done() says so.
  const DiskStoreStats st = s->stats();
  CHECK(st.bytes_written == written && st.bytes_read == read && st.errors == 0);
  CHECK(st.reads == 3 * sizes.size() && st.writes == 3 * sizes.size());
  CHECK(st.read_seconds > 0.0 && st.write_seconds > 0.0);
  CHECK_OK(s->close());
  CHECK_OK(s->close());  // idempotent
  DiskStore::Ticket t = 0;
  CHECK(s->read(0, dst[0]->p, 1, &t).code() == StatusCode::kInvalidArgument);
}

void test_unwritten_reads_zeros(const std::string& dir) {
  for (bool prealloc : {true, false}) {
    DiskStoreOptions o;
    o.preallocate = prealloc;
    std::unique_ptr<DiskStore> s;
    CHECK_OK(DiskStore::open(dir, {5000, 9000}, o, &s));
    if (!s) return;
    Buf b(9000);
    std::memset(b.p, 1, 9000);
    DiskStore::Ticket t = 0;
    CHECK_OK(s->read(1, b.p, 9000, &t));
    CHECK_OK(s->wait(t));
    bool zeros = true;
    for (std::size_t i = 0; i < 9000; ++i) zeros = zeros && b.p[i] == 0;
    CHECK(zeros);
    CHECK(s->wait(t).code() == StatusCode::kInvalidArgument);  // waited once already
  }
}

void test_file_lifecycle(const std::string& dir) {
  {  // default: the name is gone right after open; the directory stays empty
    std::unique_ptr<DiskStore> s;
    CHECK_OK(DiskStore::open(dir, {4096}, DiskStoreOptions{}, &s));
    CHECK(s && s->unlinked() && !exists(s->path()));
    CHECK(count_files(dir) == 0);
  }
  DiskStoreOptions o;
  o.unlink_on_open = false;
  std::string path;
  {
    std::unique_ptr<DiskStore> s;
    CHECK_OK(DiskStore::open(dir, {4096, 10}, o, &s));
    if (!s) return;
    path = s->path();
    struct stat st;
    CHECK(::stat(path.c_str(), &st) == 0 && (st.st_mode & 0777) == 0600 && S_ISREG(st.st_mode));
    CHECK(path.find("ramstream-") != std::string::npos);
    CHECK(!s->unlinked());
  }  // the destructor closes and removes it
  CHECK(!exists(path));
  // Exclusive: an existing name is an error, and the file that was there is left alone.
  o.file_name = "taken.store";
  const std::string taken = dir + "/taken.store";
  FILE* f = std::fopen(taken.c_str(), "w");
  std::fputs("keep me", f);
  std::fclose(f);
  std::unique_ptr<DiskStore> s;
  Status st = DiskStore::open(dir, {4096}, o, &s);
  CHECK(st.code() == StatusCode::kIoError && st.sys_errno() == EEXIST);
  CHECK(st.message().find(taken) != std::string::npos);
  char text[16] = {0};
  f = std::fopen(taken.c_str(), "r");
  CHECK(f && std::fgets(text, sizeof text, f) && std::string(text) == "keep me");
  if (f) std::fclose(f);
  ::unlink(taken.c_str());
  // A symbolic link in place of the name is refused too (O_EXCL does not follow it).
  CHECK(::symlink("/tmp/nowhere-rs", taken.c_str()) == 0);
  st = DiskStore::open(dir, {4096}, o, &s);
  CHECK(st.code() == StatusCode::kIoError && st.sys_errno() == EEXIST);
  ::unlink(taken.c_str());
  o.file_name = "a/b";
  CHECK(DiskStore::open(dir, {4096}, o, &s).code() == StatusCode::kInvalidArgument);
}

void test_bad_arguments(const std::string& dir) {
  std::unique_ptr<DiskStore> s;
  const std::string missing = dir + "/no/such/dir";
  Status st = DiskStore::open(missing, {4096}, DiskStoreOptions{}, &s);
  CHECK(st.code() == StatusCode::kIoError && st.sys_errno() == ENOENT);
  CHECK(st.message().find(missing) != std::string::npos && st.message().find("ENOENT") != std::string::npos);
  const std::string file = dir + "/plain";
  std::fclose(std::fopen(file.c_str(), "w"));
  st = DiskStore::open(file, {4096}, DiskStoreOptions{}, &s);
  CHECK(st.code() == StatusCode::kIoError && st.sys_errno() == ENOTDIR);
  ::unlink(file.c_str());
  DiskStoreOptions o;
  o.chunk_bytes = 1000;
  CHECK(DiskStore::open(dir, {4096}, o, &s).code() == StatusCode::kInvalidArgument);
  o = DiskStoreOptions{};
  o.io_threads = 0;
  CHECK(DiskStore::open(dir, {4096}, o, &s).code() == StatusCode::kInvalidArgument);

  CHECK_OK(DiskStore::open(dir, {8192, 100}, DiskStoreOptions{}, &s));
  if (!s) return;
  Buf b(8192 + 4096);
  DiskStore::Ticket t = 0;
  st = s->write(0, b.p + 64, 8192, &t);  // misaligned
  CHECK(st.code() == StatusCode::kInvalidArgument &&
        st.message().find("aligned to " + std::to_string(s->alignment())) != std::string::npos);
  CHECK(s->read(1, b.p, 99, &t).code() == StatusCode::kInvalidArgument);   // wrong size
  CHECK(s->read(2, b.p, 100, &t).code() == StatusCode::kInvalidArgument);  // no record 2
  CHECK(s->write(0, nullptr, 8192, &t).code() == StatusCode::kInvalidArgument);
  // One write in flight per record: a second request on it is refused until the first is waited.
  Buf big(64 << 20);
  std::unique_ptr<DiskStore> s2;
  CHECK_OK(DiskStore::open(dir, {big.n}, DiskStoreOptions{}, &s2));
  CHECK_OK(s2->write(0, big.p, big.n, &t));
  DiskStore::Ticket t2 = 0;
  const Status again = s2->read(0, big.p, big.n, &t2);
  CHECK(again.is_ok() || again.code() == StatusCode::kInvalidArgument);
  if (!again.is_ok()) CHECK(again.message().find("in flight") != std::string::npos);
  CHECK_OK(s2->wait(t));
  if (again.is_ok()) CHECK_OK(s2->wait(t2));  // it ran after the write had ended
  s2->discard(12345);  // unknown: nothing happens
}

// In a child: RLIMIT_FSIZE of 64 KiB, SIGXFSZ ignored. Reserving the file fails at open (EFBIG);
// without reservation the write past the limit fails at wait(), earlier records still read back,
// the failed record refuses reads until written again, and the store goes on.
int child_fsize(const std::string& dir) {
  std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit rl = {64 << 10, 64 << 10};
  if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 90;
  int bad = 0;
  std::unique_ptr<DiskStore> s;
  DiskStoreOptions o;
  Status st = DiskStore::open(dir, {16 << 10, 16 << 10, 64 << 10}, o, &s);
  if (!(st.code() == StatusCode::kIoError && st.sys_errno() == EFBIG && st.message().find("EFBIG") != std::string::npos)) ++bad;
  o.preallocate = false;
  if (!DiskStore::open(dir, {16 << 10, 16 << 10, 64 << 10}, o, &s).is_ok()) return 91;
  Buf a(16 << 10), b(16 << 10), c(64 << 10), r(64 << 10);
  std::memset(a.p, 1, a.n);
  std::memset(b.p, 2, b.n);
  std::memset(c.p, 3, c.n);
  DiskStore::Ticket t0, t1, t2;
  if (!s->write(0, a.p, a.n, &t0).is_ok() || !s->write(1, b.p, b.n, &t1).is_ok()) ++bad;
  if (!s->wait(t0).is_ok() || !s->wait(t1).is_ok()) ++bad;
  if (!s->write(2, c.p, c.n, &t2).is_ok()) ++bad;
  st = s->wait(t2);
  if (!(st.code() == StatusCode::kIoError && st.sys_errno() == EFBIG)) ++bad;
  if (st.message().find("record 2") == std::string::npos) ++bad;
  if (s->stats().errors != 1) ++bad;
  if (!s->read(0, r.p, a.n, &t0).is_ok() || !s->wait(t0).is_ok() || std::memcmp(r.p, a.p, a.n)) ++bad;
  if (!s->read(1, r.p, b.n, &t1).is_ok() || !s->wait(t1).is_ok() || std::memcmp(r.p, b.p, b.n)) ++bad;
  st = s->read(2, r.p, c.n, &t2);
  if (!(st.code() == StatusCode::kIoError && st.sys_errno() == EIO)) ++bad;
  std::memset(a.p, 9, a.n);  // the store goes on: record 0 written again and read back
  if (!s->write(0, a.p, a.n, &t0).is_ok() || !s->wait(t0).is_ok()) ++bad;
  if (!s->read(0, r.p, a.n, &t0).is_ok() || !s->wait(t0).is_ok() || std::memcmp(r.p, a.p, a.n)) ++bad;
  if (!s->close().is_ok()) ++bad;
  return bad;
}

void test_file_size_limit(const std::string& dir) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) _exit(child_fsize(dir));
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
    std::fprintf(stderr, "file-size child: %d failure(s)\n", WEXITSTATUS(status));
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(count_files(dir) == 0);
}

// Requests from several threads, then close() from several threads at once (one closes, the
// others wait for it); requests after close are refused.
void test_concurrent_close(const std::string& dir) {
  std::unique_ptr<DiskStore> s;
  DiskStoreOptions o;
  o.unlink_on_open = false;
  o.chunk_bytes = 4096;
  CHECK_OK(DiskStore::open(dir, std::vector<std::uint64_t>(8, 256 << 10), o, &s));
  if (!s) return;
  std::vector<std::unique_ptr<Buf>> bufs;
  for (int i = 0; i < 8; ++i) bufs.push_back(std::make_unique<Buf>(256 << 10));
  std::vector<std::thread> th;
  std::atomic<int> bad{0};
  for (int i = 0; i < 8; ++i)
    th.emplace_back([&, i] {
      DiskStore::Ticket t = 0;
      std::memset(bufs[i]->p, i, bufs[i]->n);
      if (!s->write(i, bufs[i]->p, bufs[i]->n, &t).is_ok()) ++bad;
      s->discard(t);  // not waited: close() still waits for it
    });
  for (auto& t : th) t.join();
  th.clear();
  for (int i = 0; i < 4; ++i) th.emplace_back([&] { if (!s->close().is_ok()) ++bad; });
  for (auto& t : th) t.join();
  CHECK(bad.load() == 0);
  CHECK(!s->is_open() && !exists(s->path()));
  CHECK(s->stats().writes == 8 && s->stats().errors == 0);
}

}  // namespace

int main() {
  const std::string dir = make_dir(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
  CHECK(!dir.empty());
  test_round_trip(dir, -1, std::size_t{8} << 20);
  test_round_trip(dir, -1, 3 * 4096);  // many chunks per request
  test_round_trip(dir, 0, 2 * 4096);   // buffered
  const std::string shm = make_dir("/dev/shm");  // tmpfs: direct or buffered, whichever it takes
  if (!shm.empty()) {
    test_round_trip(shm, -1, 4 * 4096);
    ::rmdir(shm.c_str());
  }
  test_unwritten_reads_zeros(dir);
  test_file_lifecycle(dir);
  test_bad_arguments(dir);
  test_file_size_limit(dir);
  test_concurrent_close(dir);
  CHECK(count_files(dir) == 0);
  CHECK(errno_name(ENOSPC) == "ENOSPC" && errno_name(EFBIG) == "EFBIG");
  ::rmdir(dir.c_str());
  return ramstream::test::report("test_disk_store");
}
