// Compile-time checks of psx/concepts.hpp: every built-in policy models its
// concept, the documented minimal types do too, and types that miss one
// requirement do not. A failure here is a compile error.
#include <psx/psx.hpp>

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace {

// -- the minimal conforming types of docs/concepts.md (tests/docs checks they match) --
struct AllOnServerZero {
  std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t) const {
    return {{0, 0, v.rows}};
  }
};
static_assert(psx::Partitioner<AllOnServerZero>);

struct ApplyOnArrival {
  struct State {
    psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) {
      return {};
    }
    bool may_pull(const psx::PullInfo&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return true;
    }
    bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return false;
    }
    void finish(std::span<float>, const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {}
    psx::OnWorkerLost on_worker_lost(std::size_t, const psx::ServerClock&) const {
      return psx::OnWorkerLost::shrink;
    }
  };
  State make_state(std::size_t) const { return {}; }
};
static_assert(psx::SyncPolicy<ApplyOnArrival>);

struct PlainSGD {
  float lr = 0.01f;
  std::size_t slots() const { return 0; }
  void update(std::span<float> w, std::span<const float> g, const psx::SlotView&,
              const psx::UpdateContext& ctx) const {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= static_cast<float>(lr * ctx.lr_scale) * g[i];
  }
};
static_assert(psx::Optimizer<PlainSGD>);

// -- README.md and docs/sync.md ------------------------------------------------------
using PS = psx::ParameterServer<psx::partition::RowRange,    // where rows live
                                psx::sync::Synchronous,      // when pushes apply
                                psx::optim::SGD,             // how gradients apply
                                psx::transport::InProcess>;  // how requests travel
static_assert(std::is_same_v<PS::sync_policy_type, psx::sync::Synchronous>);

[[maybe_unused]] bool hybrid_example() {
  psx::sync::Hybrid<psx::sync::Synchronous, psx::sync::Asynchronous> policy{
      .second_names = {"embedding/*"}};  // embeddings asynchronous, the rest BSP
  return psx::SyncPolicy<decltype(policy)> && policy.second_names.size() == 1;
}

// -- built-ins ------------------------------------------------------------------
static_assert(psx::Partitioner<psx::partition::HashByName>);
static_assert(psx::Partitioner<psx::partition::RoundRobin>);
static_assert(psx::Partitioner<psx::partition::RowRange>);
static_assert(psx::SyncPolicy<psx::sync::Synchronous>);
static_assert(psx::SyncPolicy<psx::sync::Asynchronous>);
static_assert(psx::SyncPolicy<psx::sync::BoundedStaleness<0>>);
static_assert(psx::SyncPolicy<psx::sync::BoundedStaleness<psx::sync::unbounded>>);
static_assert(psx::SyncPolicy<psx::sync::SyncReplicas<3>>);
static_assert(psx::SyncPolicy<psx::sync::Hybrid<psx::sync::Synchronous, psx::sync::Asynchronous>>);
static_assert(psx::detail::has_compensation<psx::sync::Asynchronous::State>);
static_assert(psx::Optimizer<psx::optim::SGD>);
static_assert(psx::Transport<psx::transport::InProcess>);
static_assert(psx::Link<psx::transport::InProcess::link_type>);
static_assert(psx::Partitioner<AllOnServerZero>);
static_assert(psx::SyncPolicy<ApplyOnArrival>);
static_assert(psx::Optimizer<PlainSGD>);

// -- one requirement missing each -------------------------------------------------
struct NoPlace {};
struct PlaceReturnsWrongType {
  int place(const psx::VariableMeta&, std::size_t) const { return 0; }
};
struct PlaceNotConst {
  std::vector<psx::Shard> place(const psx::VariableMeta&, std::size_t) { return {}; }
};
struct NotCopyable {
  NotCopyable() = default;
  NotCopyable(const NotCopyable&) = delete;
  std::vector<psx::Shard> place(const psx::VariableMeta&, std::size_t) const { return {}; }
};
static_assert(!psx::Partitioner<NoPlace>);
static_assert(!psx::Partitioner<PlaceReturnsWrongType>);
static_assert(!psx::Partitioner<PlaceNotConst>);
static_assert(!psx::Partitioner<NotCopyable>);

struct NoMakeState {};
struct StateWithoutMayPull {
  struct State {
    psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) { return {}; }
    bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return false;
    }
    void finish(std::span<float>, const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {}
    psx::OnWorkerLost on_worker_lost(std::size_t, const psx::ServerClock&) const { return psx::OnWorkerLost::fail; }
  };
  State make_state(std::size_t) const { return {}; }
};
struct StateWithoutFinish {
  struct State {
    psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) { return {}; }
    bool may_pull(const psx::PullInfo&, const psx::ShardProgress&, const psx::ServerClock&) const { return true; }
    bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return false;
    }
    psx::OnWorkerLost on_worker_lost(std::size_t, const psx::ServerClock&) const { return psx::OnWorkerLost::fail; }
  };
  State make_state(std::size_t) const { return {}; }
};
struct StateWithoutLossRule {
  struct State {
    psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) { return {}; }
    bool may_pull(const psx::PullInfo&, const psx::ShardProgress&, const psx::ServerClock&) const { return true; }
    bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
      return false;
    }
    void finish(std::span<float>, const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {}
  };
  State make_state(std::size_t) const { return {}; }
};
static_assert(!psx::SyncPolicy<NoMakeState>);
static_assert(!psx::SyncPolicy<StateWithoutMayPull>);
static_assert(!psx::SyncPolicy<StateWithoutFinish>);
static_assert(!psx::SyncPolicy<StateWithoutLossRule>);
static_assert(!psx::SyncState<StateWithoutMayPull::State>);

struct NoSlots {
  void update(std::span<float>, std::span<const float>, const psx::SlotView&, const psx::UpdateContext&) const {}
};
struct NoUpdate {
  std::size_t slots() const { return 0; }
};
struct UpdateTakesDoubles {
  std::size_t slots() const { return 0; }
  void update(std::span<double>, std::span<const double>, const psx::SlotView&, const psx::UpdateContext&) const {}
};
static_assert(!psx::Optimizer<NoSlots>);
static_assert(!psx::Optimizer<NoUpdate>);
static_assert(!psx::Optimizer<UpdateTakesDoubles>);

struct NoConnect {};
struct LinkWithoutClose {
  struct link_type {
    void send(std::size_t, psx::Request&&) {}
    void serve(std::size_t, psx::RequestHandler&) {}
  };
  std::unique_ptr<link_type> connect(const psx::TransportContext&) const { return nullptr; }
};
static_assert(!psx::Transport<NoConnect>);
static_assert(!psx::Transport<LinkWithoutClose>);

// The explain functions accept what the concepts accept.
static_assert(psx::explain_partitioner<AllOnServerZero>());
static_assert(psx::explain_sync_policy<ApplyOnArrival>());
static_assert(psx::explain_optimizer<PlainSGD>());
static_assert(psx::explain_transport<psx::transport::InProcess>());

// A server composed of the minimal types compiles.
using Minimal = psx::ParameterServer<AllOnServerZero, ApplyOnArrival, PlainSGD>;
static_assert(sizeof(Minimal) > 0);

}  // namespace
