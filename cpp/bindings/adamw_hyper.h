// AdamWHyper from a binding's arguments, shared by the host (bind_adamw.cpp) and CUDA
// (bind_cuda.cpp) AdamW bindings. Values are taken as given: the core validates them.
#pragma once
#include <cstdint>

#include "ramstream/adamw.h"

namespace ramstream::py {

inline AdamWHyper make_hyper(double lr, double beta1, double beta2, double eps,
                             double weight_decay, std::int64_t step, double grad_scale,
                             std::uint64_t seed) {
  AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.step = step;
  h.grad_scale = static_cast<float>(grad_scale);
  h.seed = seed;
  return h;
}

}  // namespace ramstream::py
