// The parts of ATen the kernels use: the Tensor class, the two ops that allocate, dtype
// dispatch and parallel_for. torch/types.h declares every op there is and triples each build.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
