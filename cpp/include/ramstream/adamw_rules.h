// The AdamW hyper-parameter rules (what lr, betas, eps, weight_decay, step and grad_scale accept):
// one definition for the host AdamW (cpp/src/adamw.cpp) and the CUDA AdamW (cuda/src/adamw.cu).
//
// The same rules, with the same wording, are python/ramstream/ops/_adamw_rules.py: a value the
// Python wrappers accept is accepted here, and the other way round.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "ramstream/adamw.h"
#include "ramstream/hd.h"
#include "ramstream/status.h"

namespace ramstream {

// The fields in the order they are checked; kAdamWHyperOk: every field is accepted.
enum AdamWHyperField : int {
  kAdamWHyperOk = -1,
  kAdamWLr = 0,
  kAdamWBeta1,
  kAdamWBeta2,
  kAdamWEps,
  kAdamWWeightDecay,
  kAdamWStep,
  kAdamWGradScale,
};

namespace adamw_rules {

RAMSTREAM_HD_INLINE bool finite(double v) {
#ifdef __CUDA_ARCH__
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

RAMSTREAM_HD_INLINE bool lr_ok(double v) { return finite(v) && v >= 0; }
RAMSTREAM_HD_INLINE bool beta_ok(double v) { return finite(v) && v >= 0 && v < 1; }
RAMSTREAM_HD_INLINE bool eps_ok(double v) { return finite(v) && v > 0; }
RAMSTREAM_HD_INLINE bool weight_decay_ok(double v) { return finite(v) && v >= 0; }
RAMSTREAM_HD_INLINE bool step_ok(std::int64_t v) { return v >= 1; }
// grad_scale is a float (the kernels multiply in float32): a finite float32.
RAMSTREAM_HD_INLINE bool grad_scale_ok(float v) { return finite(static_cast<double>(v)); }

}  // namespace adamw_rules

// The first field of `h` outside its rule, or kAdamWHyperOk.
RAMSTREAM_HD_INLINE int adamw_hyper_violation(double lr, double beta1, double beta2, double eps,
                                              double weight_decay, std::int64_t step,
                                              float grad_scale) {
  using namespace adamw_rules;
  if (!lr_ok(lr)) return kAdamWLr;
  if (!beta_ok(beta1)) return kAdamWBeta1;
  if (!beta_ok(beta2)) return kAdamWBeta2;
  if (!eps_ok(eps)) return kAdamWEps;
  if (!weight_decay_ok(weight_decay)) return kAdamWWeightDecay;
  if (!step_ok(step)) return kAdamWStep;
  if (!grad_scale_ok(grad_scale)) return kAdamWGradScale;
  return kAdamWHyperOk;
}

// Name and accepted values of each field, indexed by AdamWHyperField (host only).
inline const char* adamw_hyper_name(int field) {
  static const char* const names[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step",
                                      "grad_scale"};
  return field >= 0 && field <= kAdamWGradScale ? names[field] : "?";
}
inline const char* adamw_hyper_rule(int field) {
  static const char* const rules[] = {"a finite float >= 0", "a finite float in [0, 1)",
                                      "a finite float in [0, 1)", "a finite float > 0",
                                      "a finite float >= 0", "an int >= 1",
                                      "a finite float within float32's range"};
  return field >= 0 && field <= kAdamWGradScale ? rules[field] : "?";
}

// Host: ok, or kInvalidArgument "adamw: beta1 must be a finite float in [0, 1), got 1" naming the
// first bad field (doubles printed with 17 significant digits).
inline Status adamw_hyper_status(const AdamWHyper& h) {
  const int bad = adamw_hyper_violation(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step,
                                        h.grad_scale);
  if (bad == kAdamWHyperOk) return Status::ok();
  std::string got;
  if (bad == kAdamWStep) {
    got = std::to_string(h.step);
  } else {
    const double values[] = {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, 0.0,
                             static_cast<double>(h.grad_scale)};
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.17g", values[bad]);
    got = buf;
  }
  return Status::invalid(std::string("adamw: ") + adamw_hyper_name(bad) + " must be " +
                         adamw_hyper_rule(bad) + ", got " + got);
}

}  // namespace ramstream
