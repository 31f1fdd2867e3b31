//! @file psx/checkpoint/collective.hpp
//! Saving and restoring a cluster: collective calls in which the chief has
//! every server write or read its part and the other workers wait on
//! barriers.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/manifest.hpp>
#include <psx/checkpoint/shards.hpp>  // the server hooks: a save needs them installed
#include <psx/errors.hpp>
#include <psx/message.hpp>
#include <psx/variable.hpp>
#include <psx/worker.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <typeinfo>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

// The checkpoint code's way into a Worker.
struct WorkerAccess {
  static void call_every_server(Worker& w, Op op, std::uint64_t clock, const std::string& text,
                                const std::function<std::span<float>(std::size_t)>& answer = {}) {
    w.call_every_server(op, clock, text, answer);
  }
  static void set_clock(Worker& w, std::uint64_t clock) { w.core_->clocks[w.index_] = clock; }
  static const std::vector<VariableInfo>& variables(const Worker& w) { return w.core_->variables; }
  //! The whole variable, without waiting for the sync policy (as ParameterServer::read).
  static void read(Worker& w, std::string_view name, std::span<float> out) {
    const PullItem item{name, out};
    w.read_async(std::span<const PullItem>(&item, 1)).wait();
  }
};

}  // namespace detail

namespace checkpoint {

namespace detail {

namespace fs = std::filesystem;

template <class T>
std::string describe(const T& x) {
  if constexpr (requires(std::ostream& os) { os << x; }) {
    std::ostringstream os;
    os << x;
    return std::move(os).str();
  } else {
    return typeid(T).name();
  }
}

// What a ParameterServer tells the manifest about itself.
struct ClusterDescription {
  std::string partitioner, sync_policy, optimizer;
  std::uint64_t optimizer_slots = 0;
  std::uint64_t num_servers = 0, num_workers = 0;
};

template <class PS>
ClusterDescription describe_cluster(const PS& ps) {
  return {describe(ps.partitioner()), describe(ps.sync_policy()), describe(ps.optimizer()), ps.optimizer().slots(),
          ps.config().num_servers, ps.config().num_workers};
}

inline std::uint64_t random64() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd();
}

// Servers that read their part of the checkpoint of `step` drop it.
inline void drop_staged_restore(Worker& w, std::uint64_t step) noexcept {
  try {
    ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, step, "-");
  } catch (...) {  // a server that cannot be told drops it at the next restore
  }
}

// Runs `f` on the chief alone, then a barrier in which every worker learns
// whether it worked (Worker::agree_max): the chief rethrows its own error,
// the others throw a checkpoint_error saying the chief could not `what`.
template <class F>
void on_chief(Worker& w, const std::string& what, F&& f) {
  std::exception_ptr error;
  if (w.is_chief()) {
    try {
      f();
    } catch (const std::filesystem::filesystem_error& e) {  // creating or removing a directory
      error = std::make_exception_ptr(checkpoint_error("psx: " + what + ": " + e.what()));
    } catch (...) {
      error = std::current_exception();
    }
  }
  const bool failed = w.agree_max(error ? 1 : 0) != 0;
  if (error) std::rethrow_exception(error);
  if (failed)
    throw checkpoint_error("psx: worker " + std::to_string(w.index()) + ": the chief could not " + what +
                           " (its error says why)");
}

// A checkpoint whose own files are at fault (a manifest or shard file
// missing, truncated, corrupted, or not the one the manifest lists), as
// opposed to one this program cannot restore (other variables, another
// optimizer) or a cluster that failed: `Manager::restore_or_init` goes on
// to an older checkpoint.
class damaged_checkpoint : public checkpoint_error {
 public:
  using checkpoint_error::checkpoint_error;
};

// The chief's part of a restore (inside on_chief): checks the checkpoint in
// `dir` (of step `step`, where its directory's name says it), has every
// server read and check its part, CRCs included, and keep it aside; only
// when all of them could, has them apply it. Returns its step. Throws
// damaged_checkpoint when its files are at fault, with nothing applied on
// any server.
template <class PS>
std::uint64_t restore_on_chief(const PS& ps, Worker& w, const fs::path& dir,
                               std::optional<std::uint64_t> step = std::nullopt) {
  Manifest m;
  try {
    m = load_complete(dir, step);
  } catch (const checkpoint_error& e) {
    throw damaged_checkpoint(e.what());
  }
  check_compatible(m, dir, ::psx::detail::WorkerAccess::variables(w), ps.optimizer().slots(),
                   describe(ps.optimizer()));
  try {
    ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, m.step, dir.string());
  } catch (const checkpoint_error& e) {
    drop_staged_restore(w, m.step);
    // A server passes on the reader's error as it is, and the reader's
    // errors all come from `fail`, which names the file first; the
    // server's own (a dynamic table) name the server.
    if (std::string_view(e.what()).starts_with("psx: checkpoint file ")) throw damaged_checkpoint(e.what());
    throw;
  } catch (...) {
    drop_staged_restore(w, m.step);
    throw;
  }
  ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, m.step, "");
  return m.step;
}

}  // namespace detail

namespace detail {

// The chief's first part of a save of `step` into `abs_root`: makes the
// temporary directory the servers write into; returns it.
inline fs::path temp_dir(const fs::path& abs_root, std::uint64_t step, std::uint64_t token) {
  char suffix[24];
  std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(token));
  return abs_root / ("." + checkpoint_dir_name(step) + ".tmp-" + suffix);
}
inline fs::path begin_save_dir(const fs::path& abs_root, std::uint64_t step, std::uint64_t token = random64()) {
  fs::create_directories(abs_root);
  const fs::path temp = temp_dir(abs_root, step, token);
  fs::create_directory(temp);
  return temp;
}

// What saves that failed or crashed left in `abs_root`, all but `keep`
// (the save under way): a temporary directory is never complete; a
// replaced one (".old-") goes back into place when the crash came between
// the two renames that swap a step's checkpoint. Called once the servers
// took the save: none of them is writing another one (a background save's
// directory is not cleared while it is written).
inline void clear_leftovers(const fs::path& abs_root, const fs::path& keep) {
  std::vector<fs::path> left;
  for (const auto& e : fs::directory_iterator(abs_root))
    if (e.path().filename().string().rfind(".ckpt-", 0) == 0 && e.path() != keep) left.push_back(e.path());
  for (const fs::path& p : left) {
    const std::string name = p.filename().string();
    const auto old = name.find(".old-");
    const fs::path original = abs_root / name.substr(1, old == std::string::npos ? 0 : old - 1);
    if (old != std::string::npos && !fs::exists(original)) rename_path(p, original);
    else fs::remove_all(p);
  }
}

// The chief's last part, once every server wrote its file into `temp`:
// checks each file's header, writes the manifest, and renames `temp` into
// place as the checkpoint of `step` (replacing one of the same step).
inline fs::path finish_save_dir(const ClusterDescription& cluster, Worker& w, const fs::path& abs_root,
                                const fs::path& temp, std::uint64_t step) {
  const fs::path final_dir = abs_root / checkpoint_dir_name(step);
  Manifest m;
  m.step = step;
  m.created_unix =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  m.num_servers = cluster.num_servers;
  m.num_workers = cluster.num_workers;
  m.partitioner = cluster.partitioner;
  m.sync_policy = cluster.sync_policy;
  m.optimizer = cluster.optimizer;
  m.optimizer_slots = cluster.optimizer_slots;
  for (const VariableInfo& v : ::psx::detail::WorkerAccess::variables(w)) {
    if (v.meta.kind == VariableKind::dynamic) {
      m.tables.push_back({v.meta.name, v.meta.row_width, v.table});
      continue;
    }
    ManifestVariable mv{v.meta.name, {v.meta.shape.begin(), v.meta.shape.end()},
                        v.meta.kind == VariableKind::dense ? "dense" : "sparse", dtype_name(v.meta.dtype),
                        v.trainable, v.meta.row_width, {}};
    for (const Shard& s : v.shards) mv.shards.push_back({s.server, s.row_begin, s.row_end});
    m.variables.push_back(std::move(mv));
  }
  for (std::size_t s = 0; s < cluster.num_servers; ++s) {
    const std::string name = server_file_name(s);
    std::uint64_t size = 0;
    const auto h = read_header(temp / name, FileKind::shards, &size);
    if (h.step != step || h.server != s) fail(temp / name, "written for another step or server");
    m.files.push_back({name, size, h.crc});
  }
  write_manifest(temp, m);
  fsync_path(temp, true);
  if (fs::exists(final_dir)) {  // this step was saved before: the new one replaces it
    const std::string name = temp.filename().string();
    const fs::path old = abs_root / ("." + checkpoint_dir_name(step) + ".old-" + name.substr(name.rfind('-') + 1));
    rename_path(final_dir, old);
    rename_path(temp, final_dir);
    fs::remove_all(old);
  } else {
    rename_path(temp, final_dir);
  }
  fsync_path(abs_root, true);
  return final_dir;
}

}  // namespace detail

//! Saves the cluster's state into `root/ckpt-<step>` (step: the worker's
//! clock, the same on every worker). Collective: every worker calls it; the
//! chief has every server write its shards and its part of every dynamic
//! table (rows, slots, admission and eviction state) into a temporary directory,
//! writes the manifest, and renames the directory into place; the others
//! wait on barriers. A save that fails (on any server) leaves the earlier
//! checkpoints as they were and throws checkpoint_error on every worker
//! (the chief's own error on the chief). Training waits for the whole
//! write: `save_in_background` lets it go on meanwhile.
template <class PS>
Info save(const PS& ps, Worker& w, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  if (root.empty()) throw checkpoint_error("psx: checkpoint::save: the checkpoint directory is empty");
  const std::uint64_t step = w.clock();
  const fs::path abs_root = fs::absolute(root);
  w.barrier();  // every worker's pushes of this step have reached the servers
  // Nobody trains on while the chief saves, and everyone learns whether it could.
  detail::on_chief(w, "save the checkpoint of step " + std::to_string(step) + " in " + abs_root.string(), [&] {
    const fs::path temp = detail::begin_save_dir(abs_root, step);
    try {
      ::psx::detail::WorkerAccess::call_every_server(w, Op::save, step, temp.string());
      detail::clear_leftovers(abs_root, temp);
      detail::finish_save_dir(detail::describe_cluster(ps), w, abs_root, temp, step);
    } catch (...) {
      std::error_code ec;
      fs::remove_all(temp, ec);  // never complete (a crash leaves it to the next save)
      throw;
    }
  });
  return {abs_root / detail::checkpoint_dir_name(step), step};
}

//! A checkpoint written while training goes on, from
//! `checkpoint::save_in_background`: the state of its step, snapshotted
//! on every server, written by a thread of each server's own.
class BackgroundSave {
 public:
  BackgroundSave() = default;

  //! The step saved (the workers' clock when it began).
  std::uint64_t step() const noexcept { return step_; }
  //! Where the checkpoint will be once finished: `root/ckpt-<step>`.
  std::filesystem::path directory() const { return root_ / detail::checkpoint_dir_name(step_); }
  //! Whether it is waiting for `finish` (begun, not yet finished).
  bool pending() const noexcept { return pending_; }

  //! Whether every server has written its file (asks them; any worker may,
  //! and it is not collective). Throws the error of a server that could
  //! not (a full disk, say), and checkpoint_error when none is pending.
  bool written(Worker& w) {
    check_pending("written");
    return all_written(w);
  }

  //! Collective (every worker calls it, at the same step): waits until
  //! every server has written its file, then the chief writes the manifest
  //! and renames the directory into place, as `save` does. Returns where
  //! the checkpoint is. A save that failed on any server leaves the
  //! earlier checkpoints as they were, the servers' own state untouched,
  //! and throws checkpoint_error on every worker (the chief's own error on
  //! the chief); the save is over either way.
  Info finish(Worker& w) {
    check_pending("finish");
    pending_ = false;
    detail::on_chief(w, "finish the checkpoint of step " + std::to_string(step_) + " in " + root_.string(), [&] {
      try {
        // A server answers at once: written, or not yet. The writes take
        // a while, so the asking slows down, up to 20 ms apart.
        auto pause = std::chrono::microseconds(500);
        while (!all_written(w)) {
          std::this_thread::sleep_for(pause);
          pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(20));
        }
        detail::finish_save_dir(cluster_, w, root_, temp_, step_);
      } catch (...) {
        abandon(w);
        throw;
      }
      call_off(w);  // the servers forget the save written
    });
    return {directory(), step_};
  }

 private:
  template <class PS>
  friend BackgroundSave save_in_background(const PS& ps, Worker& w, const std::filesystem::path& root);

  // Asks every server whether it has written its file.
  bool all_written(Worker& w) {
    std::vector<std::array<float, 2>> answers(w.num_servers());
    ::psx::detail::WorkerAccess::call_every_server(
        w, Op::save, step_, "?" + temp_.string(), [&](std::size_t s) { return std::span<float>(answers[s]); });
    for (const auto& a : answers) {
      std::uint64_t v;
      std::memcpy(&v, a.data(), sizeof v);
      if (v != 1) return false;
    }
    return true;
  }

  void check_pending(const char* call) const {
    if (!pending_)
      throw checkpoint_error(std::string("psx: checkpoint::BackgroundSave::") + call +
                             ": no save is pending (none begun, or finished already)");
  }
  // The servers stop writing and forget the save; its directory goes (the chief's).
  void abandon(Worker& w) noexcept {
    call_off(w);
    std::error_code ec;
    if (!temp_.empty()) std::filesystem::remove_all(temp_, ec);
  }
  void call_off(Worker& w) noexcept {
    try {
      std::vector<std::array<float, 2>> answers(w.num_servers());
      ::psx::detail::WorkerAccess::call_every_server(
          w, Op::save, step_, "-" + temp_.string(), [&](std::size_t s) { return std::span<float>(answers[s]); });
    } catch (...) {  // a server that cannot be told forgets it at its next save
    }
  }

  std::uint64_t step_ = 0;
  std::filesystem::path root_, temp_;
  detail::ClusterDescription cluster_;
  bool pending_ = false;
};

//! Begins a save of the cluster's state into `root/ckpt-<step>` that is
//! written while training goes on; `BackgroundSave::finish` (collective,
//! at any later step) completes it. Collective: every worker calls it; the
//! workers wait only while every server snapshots its state (the dense
//! shards are copied, the dynamic tables' rows are not: a table copies a
//! row only when it is about to change before its writer has read it,
//! `DynamicTable::Snapshot`); then each server's own thread writes its
//! file as `save` would, while the server goes on serving. The checkpoint
//! holds the state of this step exactly, whatever training does
//! meanwhile, and it is complete only once finished: a crash before
//! leaves the earlier checkpoints as they were. One save at a time: a
//! server asked to save or restore while it writes throws
//! checkpoint_error. Throws as `save` when the snapshot fails.
template <class PS>
BackgroundSave save_in_background(const PS& ps, Worker& w, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  if (root.empty()) throw checkpoint_error("psx: checkpoint::save_in_background: the checkpoint directory is empty");
  BackgroundSave b;
  b.step_ = w.clock();
  b.root_ = fs::absolute(root);
  b.cluster_ = detail::describe_cluster(ps);
  // Every worker's pushes of this step have reached the servers, and every
  // worker learns the save's directory (what the servers know it by).
  const std::uint64_t token = w.agree_max(w.is_chief() ? detail::random64() : 0);
  b.temp_ = detail::temp_dir(b.root_, b.step_, token);
  detail::on_chief(w, "begin the checkpoint of step " + std::to_string(b.step_) + " in " + b.root_.string(), [&] {
    detail::begin_save_dir(b.root_, b.step_, token);
    try {
      std::vector<std::array<float, 2>> answers(w.num_servers());
      ::psx::detail::WorkerAccess::call_every_server(
          w, Op::save, b.step_, b.temp_.string(), [&](std::size_t s) { return std::span<float>(answers[s]); });
      detail::clear_leftovers(b.root_, b.temp_);
    } catch (...) {
      b.abandon(w);
      throw;
    }
  });
  b.pending_ = true;
  return b;
}

//! Restores the checkpoint in `dir` into the cluster, whatever its number of
//! servers and partitioner, and sets every worker's clock to its step;
//! returns the step. Collective: every worker calls it before training
//! (the chief reads the manifest and has every server load its shards; the
//! others learn the step from it). A dynamic table's rows go to the server
//! its ring (the declared one) names: where that is the saved ring, each
//! server reads its own file's part; otherwise every server reads every
//! file's (`DynamicTable::Restorer` says how the parts merge).
//!
//! All or nothing up to the last step: the chief checks the manifest
//! against the declared variables and every shard file's header and size;
//! then every server reads what its shards need and checks every CRC,
//! keeping it aside; only when all of them could does the chief have them
//! apply it. A checkpoint refused before that changes nothing anywhere (no
//! clock either); a server failing while it applies (a ZeroMQ server
//! restarted meanwhile, a device error) leaves the servers before it on
//! the checkpoint (restore again). A failure throws on every worker: on the
//! chief the checkpoint_error naming the file and the problem, on the
//! others one saying the chief could not.
template <class PS>
std::uint64_t restore(const PS& ps, Worker& w, const std::filesystem::path& dir) {
  if (dir.empty()) throw checkpoint_error("psx: checkpoint::restore: the checkpoint path is empty");
  const std::filesystem::path abs_dir = std::filesystem::absolute(dir);
  // Only the chief reads the manifest (in on_chief), and everyone learns
  // its step: a worker that could not read it (a host that does not see the
  // shared directory) once threw while the others waited at the barrier.
  std::optional<std::uint64_t> restored;
  // Every worker is here, none still in its last step: the servers' clocks
  // are about to be set to the checkpoint's step (without this, a restore
  // called during a run could hang a slower worker).
  w.barrier();
  // Everyone learns whether it was restored.
  detail::on_chief(w, "restore " + abs_dir.string(), [&] {
    try {
      restored = detail::restore_on_chief(ps, w, abs_dir);
    } catch (const detail::damaged_checkpoint& e) {  // the public type: only restore_or_init tells them apart
      throw checkpoint_error(e.what());
    }
  });
  const std::uint64_t step = w.agree_max(restored.value_or(0));
  ::psx::detail::WorkerAccess::set_clock(w, step);
  return step;
}

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx
