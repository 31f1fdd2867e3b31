//! @file psx/detail/persist.hpp
//! What a server hands to the checkpoint writer and reader, without knowing
//! their file format: the server core does not include cereal (only
//! psx/checkpoint.hpp does), so that header installs the two functions here
//! when a program includes it, and a server asked to save or restore
//! without them answers with a `config_error` saying what to include.
#pragma once

#include <psx/variable.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

//! An allocator whose `resize` leaves floats uninitialized (what is read
//! into them overwrites every one): no zero-fill pass before a restore.
template <class T>
struct DefaultInitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    std::allocator_traits<std::allocator<T>>::construct(static_cast<std::allocator<T>&>(*this), p, std::forward<A>(a)...);
  }
};
using FloatBuffer = std::vector<float, DefaultInitAllocator<float>>;

//! One shard as a server saves it: views of its state in host memory.
struct SavedShard {
  const VariableInfo* variable = nullptr;
  std::uint32_t index = 0;  //!< in `variable->shards`
  std::uint64_t version = 0;  //!< updates applied (the optimizer's step `t`)
  std::span<const float> params;
  std::vector<std::span<const float>> slots;  //!< one per optimizer slot, each like `params`
};

//! One shard as a server restores it: the reader fills `params`, `slots`
//! (slot-major: slot k's floats at `k * params.size()`) and `version`.
struct RestoredShard {
  const VariableInfo* variable = nullptr;
  std::uint32_t index = 0;
  std::size_t num_slots = 0;
  FloatBuffer params;
  FloatBuffer slots;
  std::uint64_t version = 0;
};

//! What a save or a restore request asks of a server.
struct PersistRequest {
  std::string directory;  //!< the checkpoint's directory
  std::uint64_t step = 0;
  std::size_t server = 0;  //!< the server asked
};

struct PersistHooks {
  //! Writes server `r.server`'s shard file into `r.directory`; throws checkpoint_error.
  void (*save)(const PersistRequest& r, std::span<const SavedShard> shards) = nullptr;
  //! Reads what `shards` need from the checkpoint in `r.directory` (whatever
  //! its layout); returns the checkpoint's step; throws checkpoint_error and
  //! then leaves `shards` unspecified (the server changes nothing).
  std::uint64_t (*restore)(const PersistRequest& r, std::span<RestoredShard> shards) = nullptr;
};

inline PersistHooks& persist_hooks() noexcept {
  static PersistHooks hooks;
  return hooks;
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
