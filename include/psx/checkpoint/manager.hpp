//! @file psx/checkpoint/manager.hpp
//! checkpoint::Manager: saves every N steps or T seconds, keeps the last
//! ones, and resumes a run from the newest checkpoint that restores whole.
#pragma once

#include <psx/checkpoint/collective.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/inspect.hpp>
#include <psx/errors.hpp>
#include <psx/worker.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace psx {
inline namespace v0 {
namespace checkpoint {

//! When and where to save, and how many checkpoints to keep.
struct Options {
  std::filesystem::path directory;
  //! Save when a worker's clock is a multiple of this (0: never by itself).
  std::uint64_t every_steps = 0;
  //! Also save when this long has passed since the last save (or the start),
  //! by the chief's clock (0: never by time). The workers agree on it every
  //! `check_every_steps` steps (`Worker::agree_max`, a barrier), so a save
  //! comes at the first such step after the time is up.
  std::chrono::seconds every_seconds{0};
  std::uint64_t check_every_steps = 10;
  //! Complete checkpoints kept; older ones are deleted after a save (0: keep all).
  std::size_t max_to_keep = 5;
  //! Saves that training does not wait for (`save_in_background`): a save
  //! snapshots the servers' state and returns; its files are written while
  //! training goes on, and the save is finished (the checkpoint made
  //! complete, older ones deleted) by the next save or `finish`. A crash
  //! before that loses this save, not the ones before it. Costs memory
  //! while a save is written: a dynamic table copies each row that changes
  //! before its writer has read it.
  bool background = false;
};

//! Saves every N steps, keeps the last `max_to_keep`, and resumes a run
//! from the newest checkpoint that restores whole.
template <class PS>
class Manager {
 public:
  Manager(const PS& ps, Options options) : ps_(&ps), options_(std::move(options)) {
    if (options_.directory.empty()) throw config_error("psx: checkpoint::Manager needs a directory");
    if (options_.every_seconds.count() < 0 || (options_.every_seconds.count() > 0 && options_.check_every_steps == 0))
      throw config_error("psx: checkpoint::Manager: every_seconds must be >= 0, and check_every_steps >= 1 with it");
  }

  const Options& options() const noexcept { return options_; }
  //! The newest complete checkpoint (`checkpoint::latest`: its data is not
  //! read), if any.
  std::optional<Info> latest() const { return checkpoint::latest(options_.directory); }
  //! Every complete checkpoint, oldest first (`checkpoint::list`).
  std::vector<Info> all() const { return checkpoint::list(options_.directory); }

  //! Collective, before training: restores the newest checkpoint that
  //! verifies whole (manifest, every shard file at its full length, every
  //! CRC, data included) and returns its step; returns 0 and changes
  //! nothing when the directory holds no checkpoint. Each newer one passed
  //! over for its files prints one line on stderr, `psx: warning:
  //! checkpoint: skipping step <step> in <directory>: <why>`; a checkpoint
  //! this program cannot restore (other variables, another optimizer)
  //! throws, as does a directory whose checkpoints are all damaged (the
  //! checkpoint_error lists each and why): a run never silently starts
  //! over from an older state, or from scratch. A worker that rejoined a
  //! job that went on without it (`Worker::rejoined`: a restarted process
  //! under `Asynchronous` or a `shrink` policy) restores nothing and calls
  //! no collective: it returns the clock `run` gave it, the others' step.
  std::uint64_t restore_or_init(Worker& w) {
    // A restarted process of a worker that the others trained on without
    // (Worker::rejoined): the job's start is long past, and the others
    // make no collective for it; it goes on from the step `run` gave it,
    // with the parameters as the others trained them.
    if (w.rejoined()) return w.clock();
    // The chief's view decides, and everyone learns it: workers that each
    // looked for themselves could see different newest checkpoints (one
    // written meanwhile, a host's stale view of a shared directory), and
    // one restoring while another went on to train called the collectives
    // out of step.
    const std::filesystem::path root = std::filesystem::absolute(options_.directory);
    std::optional<std::uint64_t> restored;
    // As in restore: no worker is still in a step when the servers' clocks are set.
    w.barrier();
    // A listing or restore that throws on the chief throws on every worker,
    // none left waiting in a collective.
    detail::on_chief(w, "restore a checkpoint from " + root.string(), [&] {
      const std::vector<Info> found = detail::checkpoint_dirs(root);
      // Tried newest first, each read once: a restore whose data fails its
      // CRC on any server is dropped by all of them before anything is
      // applied, so the next older one starts from the same state.
      std::string problems;
      for (auto c = found.rbegin(); c != found.rend(); ++c) {
        try {
          restored = detail::restore_on_chief(*ps_, w, c->path, c->step);
          return;
        } catch (const detail::damaged_checkpoint& e) {
          const std::string why(::psx::detail::without_psx_prefix(e.what()));
          std::fprintf(stderr, "psx: warning: checkpoint: skipping step %llu in %s: %s\n",
                       static_cast<unsigned long long>(c->step), root.c_str(), why.c_str());
          problems += "; step " + std::to_string(c->step) + ": " + why;
        }
      }
      if (!found.empty())
        throw checkpoint_error("psx: checkpoint: no checkpoint in " + root.string() + " can be restored (" +
                               std::to_string(found.size()) + " found), and starting from scratch would silently "
                               "discard them; repair or remove them to start afresh: " + problems.substr(2));
    });
    if (w.agree_max(restored ? 1 : 0) == 0) return 0;
    const std::uint64_t step = w.agree_max(restored.value_or(0));
    ::psx::detail::WorkerAccess::set_clock(w, step);
    return step;
  }

  //! Collective, after `w.step()`: saves when the clock is a multiple of
  //! `every_steps`, or when `every_seconds` have passed (checked every
  //! `check_every_steps` steps); returns whether it saved.
  bool maybe_save(Worker& w) {
    const std::uint64_t clock = w.clock();
    bool due = options_.every_steps > 0 && clock % options_.every_steps == 0;
    if (options_.every_seconds.count() > 0 && clock % options_.check_every_steps == 0) {
      // Only the chief's clock counts; the others learn its answer.
      const bool late = w.is_chief() && std::chrono::steady_clock::now() - last_save_ >= options_.every_seconds;
      due = w.agree_max(late ? 1 : 0) == 1 || due;
    }
    if (!due) return false;
    save(w);
    return true;
  }

  //! Collective: saves now, then deletes the oldest checkpoints of steps up
  //! to this one beyond `max_to_keep`, never the one just saved.
  //! Checkpoints of later steps (a run rolled back to an earlier one) are
  //! left alone, and `latest()` takes the highest step: remove them, or
  //! save into another directory, to resume the new run. With
  //! `background`: finishes the save before (if any), then begins this one
  //! and returns where it will be (complete once finished).
  Info save(Worker& w) {
    if (!options_.background) {
      Info info = checkpoint::save(*ps_, w, options_.directory);
      if (w.is_chief()) last_save_ = std::chrono::steady_clock::now();
      saved(w, info);
      return info;
    }
    finish(w);
    if (w.is_chief()) last_save_ = std::chrono::steady_clock::now();
    BackgroundSave& saving = background_save(w);
    saving = save_in_background(*ps_, w, options_.directory);
    return {saving.directory(), saving.step()};
  }

  //! Collective: finishes the background save begun last, if it is not
  //! finished yet (`BackgroundSave::finish`), and deletes the checkpoints
  //! beyond `max_to_keep`; returns it. Call it when training ends, or the
  //! last background save is lost. Does nothing without one pending.
  std::optional<Info> finish(Worker& w) {
    BackgroundSave& saving = background_save(w);
    if (!saving.pending()) return std::nullopt;
    Info info = saving.finish(w);
    saved(w, info);
    return info;
  }

  //! Worker `w`'s view of the background save being written, if any
  //! (`pending()`; each worker of a process sharing this manager has its own).
  BackgroundSave& background_save(const Worker& w) {
    std::lock_guard lock(saving_->mu);
    return saving_->by_worker[w.index()];  // a map's elements stay where they are
  }

 private:
  // Deletes the oldest checkpoints beyond max_to_keep (the chief).
  void saved(Worker& w, const Info& info) {
    if (w.is_chief() && options_.max_to_keep > 0) {
      std::vector<Info> older;  // oldest first, up to the one just saved
      for (const Info& c : checkpoint::list(options_.directory))
        if (c.step <= info.step) older.push_back(c);
      for (std::size_t i = 0; i + options_.max_to_keep < older.size(); ++i) {
        if (older[i].step == info.step) continue;
        std::error_code ec;
        // The manifest first: a half-deleted checkpoint is never "complete".
        std::filesystem::remove(older[i].path / detail::manifest_name, ec);
        std::filesystem::remove_all(older[i].path, ec);
      }
    }
  }

  struct Saving {
    std::mutex mu;
    std::map<std::size_t, BackgroundSave> by_worker;
  };

  const PS* ps_;
  Options options_;
  std::unique_ptr<Saving> saving_ = std::make_unique<Saving>();  // (a manager stays movable)
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();  // the chief's only
};

}  // namespace checkpoint

//! `psx::CheckpointManager<PS>`: the same as `psx::checkpoint::Manager<PS>`.
template <class PS>
using CheckpointManager = checkpoint::Manager<PS>;

}  // namespace v0
}  // namespace psx
