// Bindings for the disk tier's store (DiskStore): open, queue reads/writes of host tensors, wait on
// tickets, close, counters. I/O errors become OSError with their errno (common.cpp).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "ramstream/disk_store.h"

namespace ramstream::py {

namespace {

// Owns the core's store; the Python wrapper (ramstream.disk.store) keeps tensors alive.
struct PyDiskStore {
  std::unique_ptr<DiskStore> store;

  DiskStore& get(const char* what) {
    if (!store) raise_value_error(std::string("DiskStore.") + what + ": the store is closed");
    return *store;
  }
};

std::uint64_t byte_size(const Array& a) {
  const auto dt = a.dtype();
  return static_cast<std::uint64_t>(numel(a)) * ((dt.bits * dt.lanes + 7) / 8);
}

std::uint64_t queue(PyDiskStore& self, bool is_write, std::size_t record, const Array& t) {
  const char* what = is_write ? "write" : "read";
  require_host_buffer(t, "tensor");
  DiskStore& s = self.get(what);
  DiskStore::Ticket ticket = 0;
  void* p = t.data();
  const std::uint64_t bytes = byte_size(t);
  check_without_gil([&] {
    return is_write ? s.write(record, p, bytes, &ticket) : s.read(record, p, bytes, &ticket);
  });
  return ticket;
}

}  // namespace

void bind_disk(nb::module_& m) {
  nb::class_<PyDiskStore>(m, "DiskStore",
                          "Internal (ramstream.disk.DiskStore wraps it): fixed-size records in one "
                          "scratch file, async reads/writes on the store's own I/O threads.")
      .def(
          "__init__",
          [](PyDiskStore* self, const std::string& directory, const std::vector<std::uint64_t>& records,
             std::size_t chunk_bytes, int io_threads, bool unlink_on_open, bool preallocate, int direct,
             const std::string& file_name) {
            new (self) PyDiskStore();
            DiskStoreOptions o;
            o.chunk_bytes = chunk_bytes;
            o.io_threads = io_threads;
            o.unlink_on_open = unlink_on_open;
            o.preallocate = preallocate;
            o.direct = direct;
            o.file_name = file_name;
            check_without_gil([&] { return DiskStore::open(directory, records, o, &self->store); });
          },
          nb::arg("directory"), nb::arg("record_bytes"), nb::arg("chunk_bytes") = std::size_t{8} << 20,
          nb::arg("io_threads") = 4, nb::arg("unlink_on_open") = true, nb::arg("preallocate") = true,
          nb::arg("direct") = -1, nb::arg("file_name") = "",
          "Creates the store's file (OSError with errno and path when it cannot; ValueError for bad "
          "options). Releases the GIL.")
      .def(
          "read",
          [](PyDiskStore& self, std::size_t record, Array t) { return queue(self, false, record, t); },
          nb::arg("record"), nb::arg("tensor").noconvert(),
          "Queues a read of a record into a contiguous host tensor of exactly its bytes, aligned to "
          "alignment; returns a ticket. Keep the tensor alive until wait(ticket) returned.")
      .def(
          "write",
          [](PyDiskStore& self, std::size_t record, Array t) { return queue(self, true, record, t); },
          nb::arg("record"), nb::arg("tensor").noconvert(),
          "Queues a write of a record from a host tensor (same rules as read); returns a ticket.")
      .def(
          "wait",
          [](PyDiskStore& self, std::uint64_t ticket) {
            DiskStore& s = self.get("wait");
            check_without_gil([&] { return s.wait(ticket); });
          },
          nb::arg("ticket"), "Blocks (GIL released) until the request ended; raises its error.")
      .def(
          "done", [](PyDiskStore& self, std::uint64_t t) { return self.store && self.store->done(t); },
          nb::arg("ticket"), "True when the request ended (wait will not block).")
      .def(
          "discard",
          [](PyDiskStore& self, std::uint64_t t) {
            if (self.store) self.store->discard(t);
          },
          nb::arg("ticket"), "Forgets a ticket that will not be waited (the request still runs).")
      .def(
          "close",
          [](PyDiskStore& self) {
            if (!self.store) return;
            DiskStore* s = self.store.get();
            Status st;
            {
              nb::gil_scoped_release release;
              st = s->close();
            }
            check(st);
          },
          "Waits for every request, closes the file and removes its name (GIL released). Idempotent.")
      .def_prop_ro("is_open", [](PyDiskStore& self) { return self.store && self.store->is_open(); })
      .def_prop_ro("direct", [](PyDiskStore& self) { return self.get("direct").direct(); },
                   "True: O_DIRECT; False: buffered I/O (the filesystem refused O_DIRECT).")
      .def_prop_ro("alignment", [](PyDiskStore& self) { return self.get("alignment").alignment(); },
                   "Bytes buffers and record extents are aligned to (4096 or the filesystem's).")
      .def_prop_ro("path", [](PyDiskStore& self) { return self.get("path").path(); })
      .def_prop_ro("unlinked", [](PyDiskStore& self) { return self.get("unlinked").unlinked(); })
      .def_prop_ro("file_bytes", [](PyDiskStore& self) { return self.get("file_bytes").file_bytes(); })
      .def_prop_ro("record_bytes",
                   [](PyDiskStore& self) {
                     DiskStore& s = self.get("record_bytes");
                     std::vector<std::uint64_t> v(s.num_records());
                     for (std::size_t i = 0; i < v.size(); ++i) v[i] = s.record_bytes(i);
                     return v;
                   })
      .def(
          "stats",
          [](PyDiskStore& self) {
            const DiskStoreStats s = self.get("stats").stats();
            nb::dict d;
            d["bytes_read"] = s.bytes_read;
            d["bytes_written"] = s.bytes_written;
            d["reads"] = s.reads;
            d["writes"] = s.writes;
            d["errors"] = s.errors;
            d["read_seconds"] = s.read_seconds;
            d["write_seconds"] = s.write_seconds;
            return d;
          },
          "Counters since open (a dict); *_seconds: wall time with a request of that kind in flight.");
}

}  // namespace ramstream::py
