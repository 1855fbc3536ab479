// The checks of the C++ unit tests (ctest): CHECK / CHECK_OK count failures and go on; report()
// prints the verdict and gives main()'s exit code. Single-threaded use of the count.
#pragma once

#include <cstdio>

#include "ramstream/status.h"

namespace ramstream::test {

inline int g_failures = 0;

// main()'s return value: 0 when every check passed, else 1 with the count on stderr.
inline int report(const char* name) {
  if (g_failures) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", name, g_failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}

}  // namespace ramstream::test

#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::ramstream::test::g_failures;                                            \
    }                                                                             \
  } while (0)
#define CHECK_OK(expr)                                                                    \
  do {                                                                                    \
    ::ramstream::Status _s = (expr);                                                      \
    if (!_s.is_ok()) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,           \
                   _s.message().c_str());                                                 \
      ++::ramstream::test::g_failures;                                                    \
    }                                                                                     \
  } while (0)
