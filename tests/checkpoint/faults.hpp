// Saves that fail at every point a save can fail (checkpoint.cpp and
// tables.cpp): the previous checkpoint must survive each one.
#pragma once

#include <psx/checkpoint.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace psx_test {

// Saves into `root` (collectively, on every worker) with a failure injected
// at the save's first point (an open, a write, an fsync, a rename, on any
// server or the chief), then at its second, ... until a save goes through
// (at most 200 tries). After each failure: the error is the injected one,
// the checkpoint of step `previous` verifies, and latest() names it (or
// the new one, when only the final fsync of the directory failed, after
// the rename that completes it); then `also()`. Returns the failures.
template <class PS, class Also>
int save_through_each_failure(const PS& ps, psx::Worker& w, const std::filesystem::path& root, std::uint64_t previous,
                              Also&& also) {
  auto& countdown = psx::checkpoint::detail::fault_countdown();
  const auto step_dir = [&](std::uint64_t step) { return root / psx::checkpoint::detail::checkpoint_dir_name(step); };
  int failures = 0;
  bool saved = false;
  for (long k = 1; k < 200 && !saved; ++k) {
    countdown = k;
    try {
      psx::checkpoint::save(ps, w, root);
      saved = true;
    } catch (const psx::checkpoint_error& e) {
      const std::string what = e.what();
      CHECK(what.find("injected failure") != std::string::npos);
      ++failures;
      psx::checkpoint::verify(step_dir(previous));
      const auto latest = psx::checkpoint::latest(root);
      REQUIRE(latest);
      CHECK((latest->step == previous || (latest->step == w.clock() && what.find("fsync") != std::string::npos)));
      psx::checkpoint::verify(latest->path);
      also();
    }
    countdown = 0;
  }
  CHECK(saved);
  return failures;
}

}  // namespace psx_test
