// Compile-fail test: a ParameterServer composed with a policy that misses one
// member must fail with psx's message naming that member. Built with
// -DPSX_BREAK=<n> (1 partitioner, 2 sync policy, 3 optimizer, 4 transport)
// it must fail; built without PSX_BREAK (the must-compile twin) it must compile,
// which proves the failures come from the missing member and nothing else.
#include <psx/psx.hpp>

#ifndef PSX_BREAK
#define PSX_BREAK 0
#endif

struct Partitioner {
#if PSX_BREAK != 1
  std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t) const { return {{0, 0, v.rows}}; }
#endif
};

struct Sync {
  struct State {
    psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) { return {}; }
#if PSX_BREAK != 2
    bool may_pull(const psx::PullInfo&, const psx::ShardProgress&, const psx::ServerClock&) const { return true; }
#endif
    bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return false;
    }
    void finish(std::span<float>, const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {}
    psx::OnWorkerLost on_worker_lost(std::size_t, const psx::ServerClock&) const { return psx::OnWorkerLost::shrink; }
  };
  State make_state(std::size_t) const { return {}; }
};

struct Optimizer {
  std::size_t slots() const { return 0; }
#if PSX_BREAK != 3
  void update(std::span<float>, std::span<const float>, const psx::SlotView&, const psx::UpdateContext&) const {}
#endif
};

struct Transport {
  struct link_type {
    void send(std::size_t, psx::Request&&) {}
    void serve(std::size_t, psx::RequestHandler&) {}
#if PSX_BREAK != 4
    void close() noexcept {}
#endif
  };
  std::unique_ptr<link_type> connect(const psx::TransportContext&) const { return std::make_unique<link_type>(); }
};

int main() {
  psx::ParameterServer<Partitioner, Sync, Optimizer, Transport> ps({1, 1});
  return static_cast<int>(ps.variables().size());
}
