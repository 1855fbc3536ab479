// CPU feature detection (cpuid + xgetbv via GCC builtins) and the cached active ISA.
#include "ramstream/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace ramstream {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Status parse_isa(const char* name, Isa* out) {
  if (name == nullptr) return Status::invalid("isa name is null");
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(name, isa_name(isa)) == 0) {
      *out = isa;
      return Status::ok();
    }
  }
  return Status::invalid(std::string("unknown ISA '") + name +
                         "'; accepted: 'scalar', 'avx2', 'avx512'");
}

Isa best_supported_isa() {
#if defined(RAMSTREAM_HAVE_X86_ISAS) && (defined(__x86_64__) || defined(_M_X64))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

namespace {
std::atomic<int> g_active{-1};
std::once_flag g_once;
std::string g_env_error;

void init_active() {
  Isa best = best_supported_isa();
  Isa chosen = best;
  if (const char* env = std::getenv("RAMSTREAM_FORCE_ISA"); env && *env) {
    Isa forced;
    Status s = parse_isa(env, &forced);
    if (!s.is_ok()) {
      g_env_error = "RAMSTREAM_FORCE_ISA: " + s.message();
    } else if (static_cast<int>(forced) > static_cast<int>(best)) {
      g_env_error = std::string("RAMSTREAM_FORCE_ISA=") + env + " but this CPU supports at most " +
                    isa_name(best);
    } else {
      chosen = forced;
    }
  }
  int expected = -1;
  g_active.compare_exchange_strong(expected, static_cast<int>(chosen));
}
}  // namespace

Isa active_isa() {
  std::call_once(g_once, init_active);
  return static_cast<Isa>(g_active.load(std::memory_order_relaxed));
}

const char* isa_env_error() {
  std::call_once(g_once, init_active);
  return g_env_error.c_str();
}

Status set_active_isa(Isa isa) {
  std::call_once(g_once, init_active);
  Isa best = best_supported_isa();
  if (static_cast<int>(isa) > static_cast<int>(best))
    return Status::unsupported(std::string("ISA ") + isa_name(isa) +
                               " is not supported by this CPU/build (best: " + isa_name(best) + ")");
  g_active.store(static_cast<int>(isa), std::memory_order_relaxed);
  return Status::ok();
}

}  // namespace ramstream
