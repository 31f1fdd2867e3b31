// A gate in front of every server's shard file write (the checkpoint
// hooks' save): closed, a server's writer waits at it, so a background save
// is still being written while the test trains on (background.cpp,
// tables.cpp). Open by default; a writer waits 60 s at most.
#pragma once

#include <psx/checkpoint.hpp>

#include <atomic>
#include <chrono>
#include <span>
#include <thread>

namespace psx_test {

class WriteGate {
 public:
  // Installs the gate, closed; the destructor opens it and puts the
  // hook back.
  WriteGate() : original_(hooks().save) {
    open_.store(false);
    waited_.store(0);
    hooks().save = &save;
  }
  WriteGate(const WriteGate&) = delete;
  WriteGate& operator=(const WriteGate&) = delete;
  ~WriteGate() {
    open();
    hooks().save = original_;
  }

  void open() noexcept { open_.store(true); }
  // Opens once `n` writes in all have come to it (or after 30 s): what
  // waited is then known, whatever the threads' timing.
  void open_when_waited(int n) noexcept {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (waited_.load() < n && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    open();
  }
  void close() noexcept { open_.store(false); }
  // Writes that found the gate closed and waited.
  int waited() const noexcept { return waited_.load(); }

 private:
  using Save = decltype(psx::detail::PersistHooks::save);
  static psx::detail::PersistHooks& hooks() { return psx::detail::persist_hooks(); }

  static void save(const psx::detail::PersistRequest& r, std::span<const psx::detail::SavedShard> shards,
                   std::span<const psx::detail::SavedTable> tables) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    if (!open_.load()) waited_.fetch_add(1);
    while (!open_.load() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    psx::checkpoint::detail::write_server_file(r, shards, tables);
  }

  Save original_;
  static inline std::atomic<bool> open_{true};
  static inline std::atomic<int> waited_{0};
};

}  // namespace psx_test
