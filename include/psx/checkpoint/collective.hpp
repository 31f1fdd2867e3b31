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

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

// The checkpoint code's way into a Worker.
struct WorkerAccess {
  static void call_every_server(Worker& w, Op op, std::uint64_t clock, const std::string& text) {
    w.call_every_server(op, clock, text);
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

//! Saves the cluster's state into `root/ckpt-<step>` (step: the worker's
//! clock, the same on every worker). Collective: every worker calls it; the
//! chief has every server write its shards and its part of every dynamic
//! table (rows, slots, admission and eviction state) into a temporary directory,
//! writes the manifest, and renames the directory into place; the others
//! wait on barriers. A save that fails (on any server) leaves the earlier
//! checkpoints as they were and throws checkpoint_error on every worker
//! (the chief's own error on the chief).
template <class PS>
Info save(const PS& ps, Worker& w, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  if (root.empty()) throw checkpoint_error("psx: checkpoint::save: the checkpoint directory is empty");
  const std::uint64_t step = w.clock();
  const fs::path abs_root = fs::absolute(root);
  const fs::path final_dir = abs_root / detail::checkpoint_dir_name(step);
  w.barrier();  // every worker's pushes of this step have reached the servers
  // Nobody trains on while the chief saves, and everyone learns whether it could.
  detail::on_chief(w, "save the checkpoint of step " + std::to_string(step) + " in " + abs_root.string(), [&] {
    fs::create_directories(abs_root);
    // What a save that failed or crashed left: a temporary directory is
    // never complete; a replaced one (".old-") goes back into place when
    // the crash came between the two renames that swap a step's checkpoint.
    std::vector<fs::path> left;
    for (const auto& e : fs::directory_iterator(abs_root))
      if (e.path().filename().string().rfind(".ckpt-", 0) == 0) left.push_back(e.path());
    for (const fs::path& p : left) {
      const std::string name = p.filename().string();
      const auto old = name.find(".old-");
      const fs::path original = abs_root / name.substr(1, old == std::string::npos ? 0 : old - 1);
      if (old != std::string::npos && !fs::exists(original)) detail::rename_path(p, original);
      else fs::remove_all(p);
    }
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(detail::random64()));
    const fs::path temp = abs_root / ("." + detail::checkpoint_dir_name(step) + ".tmp-" + suffix);
    fs::create_directory(temp);
    ::psx::detail::WorkerAccess::call_every_server(w, Op::save, step, temp.string());
    const auto cluster = detail::describe_cluster(ps);
    Manifest m;
    m.step = step;
    m.created_unix = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
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
      const std::string name = detail::server_file_name(s);
      std::uint64_t size = 0;
      const auto h = detail::read_header(temp / name, detail::FileKind::shards, &size);
      if (h.step != step || h.server != s) detail::fail(temp / name, "written for another step or server");
      m.files.push_back({name, size, h.crc});
    }
    detail::write_manifest(temp, m);
    detail::fsync_path(temp, true);
    if (fs::exists(final_dir)) {  // this step was saved before: the new one replaces it
      const fs::path old = abs_root / ("." + detail::checkpoint_dir_name(step) + ".old-" + suffix);
      detail::rename_path(final_dir, old);
      detail::rename_path(temp, final_dir);
      fs::remove_all(old);
    } else {
      detail::rename_path(temp, final_dir);
    }
    detail::fsync_path(abs_root, true);
  });
  return {final_dir, step};
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
