//! @file psx/errors.hpp
//! The exception types psx throws. Every message names the variable, the peer
//! or the file involved and the sizes that disagree.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace psx {
inline namespace v0 {

//! Base of every exception psx throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! A variable name that was never declared.
class unknown_variable : public error {
 public:
  using error::error;
};

//! A name declared twice.
class duplicate_variable : public error {
 public:
  using error::error;
};

//! A buffer, shape or count that does not match the variable's.
class shape_error : public error {
 public:
  using error::error;
};

//! A sparse row id outside `[0, rows)`.
class row_out_of_range : public error {
 public:
  using error::error;
};

//! A push to a variable declared with `trainable = false`.
class frozen_variable : public error {
 public:
  using error::error;
};

//! A call made after `shutdown()`, or a request cut short by it.
class shutdown_error : public error {
 public:
  using error::error;
};

//! A bad configuration: zero servers, an invalid placement, declaring after start.
class config_error : public error {
 public:
  using error::error;
};

//! A request the sync policy refuses (for example a push for a step already applied).
class sync_error : public error {
 public:
  using error::error;
};

//! A malformed, truncated or oversized message.
class wire_error : public error {
 public:
  using error::error;
};

//! A truncated, corrupted or incompatible checkpoint or export.
class checkpoint_error : public error {
 public:
  using error::error;
};

//! A TensorBoard event file that cannot be created or written, a summary
//! writer used after `close()`, or an event record that is truncated,
//! corrupted or malformed (psx/summary.hpp; the message names the file and
//! the record's byte offset).
class summary_error : public error {
 public:
  using error::error;
};

//! A peer (worker or server) that died or stopped answering.
class peer_lost : public error {
 public:
  using error::error;
};

namespace detail {

// An error's message without its leading "psx: ", for a message that says
// more of where it arose ("psx: worker 0: pull of variable 'w': " + this).
inline std::string_view without_psx_prefix(std::string_view what) noexcept {
  if (what.starts_with("psx: ")) what.remove_prefix(5);
  return what;
}

}  // namespace detail

}  // namespace v0
}  // namespace psx
