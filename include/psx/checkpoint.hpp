//! @file psx/checkpoint.hpp
//! Sharded checkpoints: every server writes its own shards (parameters and
//! optimizer slots) and its part of every dynamic table (rows, slots,
//! admission and eviction state), the chief writes a manifest, and a
//! checkpoint restores into any number of servers and any partitioner, bit
//! for bit.
//!
//! @code
//! psx::checkpoint::Manager ckpt(ps, {.directory = "/shared/run1", .every_steps = 100, .max_to_keep = 5});
//! ps.run([&](psx::Worker& w) {
//!   for (std::uint64_t step = ckpt.restore_or_init(w); step < 1000; ++step) {
//!     ...pull, compute, push...
//!     w.step();
//!     ckpt.maybe_save(w);  // every worker calls it; only the chief writes
//!   }
//! });
//! @endcode
//!
//! Save and restore are collective: every worker calls them at the same
//! step; the others wait on a barrier while the chief saves, never on a
//! sleep. Servers write into the directory the chief names, so between hosts
//! it must be a file system every task sees at the same path (as with
//! TensorFlow). The format is in docs/formats.md. Only this header, the
//! pieces it includes (psx/checkpoint/) and psx/export.hpp include cereal.
#pragma once

#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/manifest.hpp>
#include <psx/checkpoint/shards.hpp>
#include <psx/checkpoint/inspect.hpp>
#include <psx/checkpoint/collective.hpp>
#include <psx/checkpoint/manager.hpp>
