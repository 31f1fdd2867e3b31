//! @file psx/psx.hpp
//! The umbrella header of psx's core: concepts, variables, the built-in
//! policies, the in-process transport and `psx::ParameterServer`.
//! It includes no Eigen, xtensor, ZeroMQ, cereal or CUDA header; those
//! parts are opt-in (`psx/eigen.hpp`, `psx/xtensor.hpp`, ...).
#pragma once

#define PSX_VERSION_MAJOR 0
#define PSX_VERSION_MINOR 1
#define PSX_VERSION_PATCH 0

#include <psx/cluster.hpp>
#include <psx/embedding.hpp>
#include <psx/concepts.hpp>
#include <psx/errors.hpp>
#include <psx/gradients.hpp>
#include <psx/half.hpp>
#include <psx/message.hpp>
#include <psx/optim.hpp>
#include <psx/parameter_server.hpp>
#include <psx/partition.hpp>
#include <psx/pruning.hpp>
#include <psx/schedule.hpp>
#include <psx/server.hpp>
#include <psx/storage.hpp>
#include <psx/sync.hpp>
#include <psx/transport/inprocess.hpp>
#include <psx/transport/simulated.hpp>
#include <psx/variable.hpp>
#include <psx/worker.hpp>
