//! @file psx/cuda/kernels.cuh
//! Every CUDA kernel of psx, for a translation unit compiled by nvcc. Never
//! included by `psx/psx.hpp`.
//!
//! | header                   | what                                                        |
//! | ------------------------ | ----------------------------------------------------------- |
//! | `psx/cuda/memory.cuh`    | `check`, `buffer<T>`                                        |
//! | `psx/cuda/optim.cuh`     | `update`, `update_rows`, `DeviceSlots` for the optimizers   |
//! | `psx/cuda/rows.cuh`      | `gather_rows`, `RowDedup`                                   |
//! | `psx/cuda/aggregate.cuh` | `aggregate` of k workers' gradients                         |
//! | `psx/cuda/convert.cuh`   | bfloat16/float16 `convert`, `quantize_int8`, `dequantize_int8` |
#pragma once

#include <psx/cuda/aggregate.cuh>
#include <psx/cuda/convert.cuh>
#include <psx/cuda/memory.cuh>
#include <psx/cuda/optim.cuh>
#include <psx/cuda/rows.cuh>
