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
#include <functional>
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

//! Bytes of one row of a dynamic table in a checkpoint: its id, the global
//! steps of its last update and of its last use (u64 each), then its `dim`
//! floats and each optimizer slot's `dim` floats.
inline constexpr std::uint64_t table_row_bytes(std::uint64_t dim, std::uint64_t slots) noexcept {
  return 3 * sizeof(std::uint64_t) + dim * (1 + slots) * sizeof(float);
}

//! What a checkpoint keeps of one server's part of a dynamic table besides
//! its rows and its admission sketch's counters.
struct TableState {
  std::uint64_t dim = 0;
  std::uint64_t slots = 0;           //!< optimizer slots per float
  std::uint64_t rows = 0;            //!< rows stored
  std::uint64_t shard_version = 0;   //!< updates the server applied to the table (its shard's version)
  std::uint64_t version = 0;         //!< the table's changes so far (`DynamicTable::version`)
  std::uint64_t next_sweep = 0;      //!< the global step from which the next time-to-live sweep is due
  std::uint64_t admitted = 0, refused = 0, evicted_ttl = 0, evicted_memory = 0;  //!< `TableStats`' counters
  std::uint32_t sketch_width = 0;    //!< the admission sketch's counters per row (0: no sketch)
  std::uint32_t sketch_depth = 0;    //!< and its rows
  std::uint64_t sketch_added = 0;    //!< pushes the sketch counted (where its window stands)
  //! Per stripe, the index entries and the chunks of records whose memory
  //! it counts (against the memory cap), two numbers each.
  std::vector<std::uint64_t> layout;
};

//! One server's part of a dynamic table as it saves it.
struct SavedTable {
  const VariableInfo* variable = nullptr;
  TableState state;
  std::vector<std::uint8_t> sketch;  //!< `sketch_width * sketch_depth` counters, row after row
  //! Calls its argument with every stored row (`table_row_bytes` each),
  //! a block of whole rows at a time; `state.rows` rows in all.
  std::function<void(const std::function<void(std::span<const std::byte>)>&)> rows;
};

//! What takes the saved parts of a dynamic table while a checkpoint is
//! read: a server's table being restored, or a reader without a cluster.
//! Nothing it is given is trusted: the reader checks the CRCs only after
//! the bytes went in, so a part's rows may be damaged; `damage()` then
//! says what was wrong with them, and the reader throws.
class TableLoader {
 public:
  virtual ~TableLoader() = default;
  //! Saved server `server`'s part (of `servers`, on a ring of
  //! `virtual_nodes` points each), before its rows and counters.
  virtual void begin_part(std::size_t server, std::size_t servers, std::uint32_t virtual_nodes, const TableState& state) = 0;
  //! Whole rows of the part begun last, in order, in any number of calls.
  virtual void add_rows(std::span<const std::byte> rows) = 0;
  //! Bytes `[offset, offset + counters.size())` of its admission sketch.
  virtual void add_sketch(std::uint64_t offset, std::span<const std::byte> counters) = 0;
  //! A problem with the rows given so far (an id saved twice) and the
  //! server whose part showed it, or an empty text.
  virtual std::pair<std::size_t, std::string> damage() const = 0;
  //! After the last part: what the rows cannot be for this program (more
  //! than its memory cap holds) throws checkpoint_error.
  virtual void finish() = 0;
};

//! One dynamic table as a server restores it: the rows the reader gives
//! `loader` are every saved server's rows (the loader keeps those the
//! table's ring now gives server `server`), or, when the table's ring is
//! the saved one, those of server `server`'s own file.
struct RestoredTable {
  const VariableInfo* variable = nullptr;
  std::size_t server = 0;
  TableLoader* loader = nullptr;
};

//! What a save or a restore request asks of a server.
struct PersistRequest {
  std::string directory;  //!< the checkpoint's directory
  std::uint64_t step = 0;
  std::size_t server = 0;  //!< the server asked
};

struct PersistHooks {
  //! Writes server `r.server`'s shard file into `r.directory`; throws checkpoint_error.
  void (*save)(const PersistRequest& r, std::span<const SavedShard> shards, std::span<const SavedTable> tables) = nullptr;
  //! Reads what `shards` and `tables` need from the checkpoint in
  //! `r.directory` (whatever its layout); returns the checkpoint's step;
  //! throws checkpoint_error and then leaves them unspecified (the server
  //! changes nothing).
  std::uint64_t (*restore)(const PersistRequest& r, std::span<RestoredShard> shards,
                           std::span<RestoredTable> tables) = nullptr;
};

inline PersistHooks& persist_hooks() noexcept {
  static PersistHooks hooks;
  return hooks;
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
