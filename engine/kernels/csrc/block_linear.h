// The body of every block-quantized linear op (q4/q8/kq_linear in block_matmul.cpp, q5_linear in
// block_q5.cpp), for files that include ATen (block_matmul.h stays free of it for the ISA files).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "block_matmul.h"

namespace kvblock {

// x [M, K] float32 @ w^T (+ bias) on the current kernel path: activations quantized once, column
// groups split across the threads, rows in panels of kRowPanel.
at::Tensor block_linear(const at::Tensor& x, const AnyWeight& w,
                        const std::optional<at::Tensor>& bias);

}  // namespace kvblock
