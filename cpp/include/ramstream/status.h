// Status: the error path of the whole core. Functions return a Status; none throws or exits.
#pragma once
#include <string>
#include <utility>

namespace ramstream {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad sizes, dtypes, pointers or hyper-parameters (-> ValueError)
  kOutOfMemory,      // an allocation or budget failed (-> MemoryError)
  kCudaError,        // a CUDA runtime call failed (-> RuntimeError)
  kUnsupported,      // not available in this build or on this machine (-> RuntimeError)
  kInternal,         // a bug (-> RuntimeError)
  kIoError,          // a system call on a file failed; errno() says which (-> OSError)
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return Status(); }
  static Status invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status oom(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
  static Status cuda(std::string m) { return {StatusCode::kCudaError, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // A failed file operation: `err` is the errno value (ENOSPC, EFBIG, EIO, ...).
  static Status io(int err, std::string m) {
    Status s(StatusCode::kIoError, std::move(m));
    s.errno_ = err;
    return s;
  }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  int sys_errno() const { return errno_; }  // the errno of a kIoError, else 0

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int errno_ = 0;
};

}  // namespace ramstream

// Returns early from the enclosing function when `expr` yields a non-ok Status.
#define RAMSTREAM_RETURN_IF_ERROR(expr)          \
  do {                                           \
    ::ramstream::Status _rs_status = (expr);     \
    if (!_rs_status.is_ok()) return _rs_status;  \
  } while (0)
