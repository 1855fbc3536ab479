// Unit tests (ctest) of the headers shared by the host and CUDA AdamW: the hyper-parameter rules
// (ramstream/adamw_rules.h) at their boundaries, with the messages adamw_step returns, and the
// stochastic-rounding hash (ramstream/rounding.h) against the spec formula written out in 64 bits.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "ramstream/adamw.h"
#include "ramstream/adamw_rules.h"
#include "ramstream/rounding.h"
#include "ramstream/thread_pool.h"

using namespace ramstream;

namespace {

int g_failures = 0;
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

const double kInf = std::numeric_limits<double>::infinity();
const double kNan = std::numeric_limits<double>::quiet_NaN();

// docs/NUMERICS.md rule 2 spelled out with 64-bit products reduced mod 2^32 at each step.
std::uint32_t spec_bits(std::uint64_t seed, std::int64_t step, std::uint64_t idx, std::uint32_t moment) {
  const std::uint64_t m32 = 0xFFFFFFFFull;
  std::uint64_t k = ((idx & m32) * 0x9E3779B1ull) & m32;
  k = (k + (idx >> 32) * 0x85EBCA77ull) & m32;
  k = (k + (seed & m32) * 0xC2B2AE3Dull) & m32;
  k = (k + (seed >> 32) * 0x27D4EB2Full) & m32;
  k = (k + (static_cast<std::uint64_t>(step) & m32) * 0x165667B1ull) & m32;
  k = (k + moment * 0xD3A2646Cull) & m32;
  k ^= k >> 16;
  k = (k * 0x7FEB352Dull) & m32;
  k ^= k >> 15;
  k = (k * 0x846CA68Bull) & m32;
  k ^= k >> 16;
  return static_cast<std::uint32_t>(k & 0xFFFFu);
}

void test_hash() {
  const std::uint64_t seeds[] = {0, 1, 0xDEADBEEFCAFEF00Dull, ~0ull};
  const std::int64_t steps[] = {1, 2, 1000003, (std::int64_t{1} << 40) + 7};
  const std::uint64_t idxs[] = {0, 1, 15, 16, 65535, (1ull << 32) - 1, 1ull << 32, (1ull << 62) + 5};
  for (auto seed : seeds)
    for (auto step : steps)
      for (auto idx : idxs)
        for (std::uint32_t moment = 0; moment < 2; ++moment) {
          const std::uint32_t want = spec_bits(seed, step, idx, moment);
          CHECK(rounding::bits(rounding::key_base(seed, step), idx, moment) == want);
          CHECK(rounding::finish(rounding::index_term(idx) + rounding::key(seed, step, moment)) == want);
          CHECK(sr_bits(seed, step, static_cast<std::int64_t>(idx), static_cast<int>(moment)) == want);
        }
}

AdamWHyper good() {
  AdamWHyper h;
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.01;
  h.step = 1;
  h.grad_scale = 1.0f;
  return h;
}

int violation(const AdamWHyper& h) {
  return adamw_hyper_violation(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.grad_scale);
}

// A good hyper with one double field set to v: the verdict.
int with(double AdamWHyper::*field, double v) {
  AdamWHyper h = good();
  h.*field = v;
  return violation(h);
}

void test_rules() {
  CHECK(violation(good()) == kAdamWHyperOk);
  struct Case {
    double AdamWHyper::*field;
    int code;
    double ok[3];
    double bad[4];
  };
  const double below_one = std::nextafter(1.0, 0.0);
  const Case cases[] = {
      {&AdamWHyper::lr, kAdamWLr, {0.0, -0.0, 1e300}, {-1e-300, kNan, kInf, -kInf}},
      {&AdamWHyper::beta1, kAdamWBeta1, {0.0, below_one, 0.5}, {1.0, -1e-300, kNan, kInf}},
      {&AdamWHyper::beta2, kAdamWBeta2, {0.0, below_one, 0.5}, {1.0, -1e-300, kNan, -kInf}},
      {&AdamWHyper::eps, kAdamWEps, {4.9e-324, 1e300, 1.0}, {0.0, -1e-8, kNan, kInf}},
      {&AdamWHyper::weight_decay, kAdamWWeightDecay, {0.0, 1e300, 0.1}, {-1e-300, kNan, kInf, -1.0}},
  };
  for (const Case& c : cases) {
    for (double v : c.ok) CHECK(with(c.field, v) == kAdamWHyperOk);
    for (double v : c.bad) CHECK(with(c.field, v) == c.code);
  }
  AdamWHyper h = good();
  h.step = 0;
  CHECK(violation(h) == kAdamWStep);
  h.step = std::numeric_limits<std::int64_t>::max();
  CHECK(violation(h) == kAdamWHyperOk);
  h = good();
  h.grad_scale = FLT_MAX;
  CHECK(violation(h) == kAdamWHyperOk);
  h.grad_scale = -std::numeric_limits<float>::infinity();
  CHECK(violation(h) == kAdamWGradScale);
  h.grad_scale = std::numeric_limits<float>::quiet_NaN();
  CHECK(violation(h) == kAdamWGradScale);
  // several bad fields: the first in the documented order is reported
  h = good();
  h.eps = 0;
  h.lr = -1;
  CHECK(violation(h) == kAdamWLr);
}

void test_messages() {
  ThreadPool pool(1);
  float p = 1, g = 1, m = 0, v = 0;
  AdamWBuffers b;
  b.param = &p;
  b.grad = &g;
  b.exp_avg = &m;
  b.exp_avg_sq = &v;
  b.n = 1;
  AdamWHyper h = good();
  h.beta1 = 1.0;
  const Status s = adamw_step(b, h, pool);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() == "adamw: beta1 must be a finite float in [0, 1), got 1");
  CHECK(p == 1.0f && m == 0.0f);  // nothing written
  h = good();
  h.step = -3;
  CHECK(adamw_step(b, h, pool).message() == "adamw: step must be an int >= 1, got -3");
  h = good();
  h.eps = 0.0;
  CHECK(validate_adamw_hyper(h).message() == "adamw: eps must be a finite float > 0, got 0");
  for (int f = kAdamWLr; f <= kAdamWGradScale; ++f) {
    CHECK(std::string(adamw_hyper_name(f)) != "?");
    CHECK(std::string(adamw_hyper_rule(f)) != "?");
  }
  CHECK(adamw_step(b, good(), pool).is_ok());
  CHECK(p != 1.0f);
}

}  // namespace

int main() {
  test_hash();
  test_rules();
  test_messages();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_adamw_rules: ok\n");
  return 0;
}
