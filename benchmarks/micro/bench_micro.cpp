// bench_micro: Google Benchmark kernels for the hot paths, each family next
// to its floor or reference, measured in the same run on the same data.
//
// 1. Partitioner lookup (`partition/...`). A sparse push or pull of rows
//    spread over several shards maps every id to its shard with
//    `VariableInfo::shard_of_row` (a binary search over the placement the
//    partitioner made once, at declaration), then `Worker::send_rows` groups
//    the ids by shard with a counting sort. Measured on 100k Zipf ids (s=1.1
//    over 1M rows, hot ids scattered over the table) for every built-in
//    partitioner:
//      BM_partition_shard_of_row  the per-id lookup alone, written into an
//                                 array as the worker does;
//      BM_partition_worker_split  the whole worker path, `push_rows_async`
//                                 then `wait` on a transport that answers at
//                                 once: id checks, lookup, counting sort,
//                                 the requests and their completion;
//      BM_floor_memcpy_ids        floor: one copy of the ids (8 bytes each),
//                                 the least a split can move (read every id,
//                                 write it into its group once).
//    HashByName and RoundRobin put a variable on one shard: the worker then
//    sends the caller's ids as they are, and the lookup is never called.
//
// 2. Wire format (`wire/...`, psx/detail/wire.hpp), for a dense push of
//    1 MiB (one variable, and 256 variables of 4 KiB: a batched push), a
//    sparse push of 10k ids x 16 floats, and the replies of the matching
//    pulls (1 MiB, 10k x 16 floats).
//      encode  writes the header only; the payload frames are borrowed
//              spans. Floor: BM_floor_header, allocating and writing a
//              header of the same size.
//      decode  checks every count and size against the frames and points
//              the request's spans into them: no payload byte is copied.
//              Its floor is that validation pass itself; it should not grow
//              with the payload.
//      BM_floor_memcpy_payload  reference: one memcpy of the payload bytes,
//              what a codec that copies would pay at the least. Encode and
//              decode should be far below it.
//    Bytes/s count the payload bytes in every benchmark of the family, so
//    the rates compare directly.
//
// 3. Summing the rows of repeated ids (`dedup/...`). The worker does not
//    deduplicate: it sends ids as the caller gave them, and the server sums
//    repeated ids before the optimizer sees them, with
//    `detail::RowAccumulator` (psx/storage.hpp, open addressing;
//    `Server::scratch_rows` reuses one, `reset` per push_rows request).
//    Measured on 100k Zipf ids (s=1.1 over 1M rows) for row widths 16 and 64:
//      BM_dedup_row_accumulator         a fresh accumulator per request (as
//                                       a sync policy's per-worker sums are),
//                                       `add` per id;
//      BM_dedup_row_accumulator_reused  as `Server::scratch_rows`: one
//                                       accumulator `reset` between requests
//                                       (no allocation in steady state);
//      BM_ref_sort_unique_ids           reference: std::sort + std::unique
//                                       of a copy of the ids (rows not summed);
//      BM_floor_memcpy_grad             floor: one memcpy of the gradient
//                                       rows (read once, written once).
//    Bytes/s count the gradient bytes.
//
// 4. Declaring many variables (`place/...`). `partition::LeastLoaded` is told
//    what each server holds at every declare and puts each shard on the
//    least loaded server:
//      BM_place_least_loaded  declares `vars` variables of `shards` shards
//                             each on `servers` servers (a fresh cluster per
//                             iteration);
//      BM_ref_place_fixed     reference: the same declares with
//                             FixedShards, which deals shards without
//                             looking at loads.
//    Both should grow linearly with the variables (items/s: variables).
//
//   ./bench_micro [--benchmark_filter=REGEX] [other Google Benchmark flags]
#include "../zipf.hpp"

#include <psx/detail/wire.hpp>
#include <psx/parameter_server.hpp>
#include <psx/partition.hpp>
#include <psx/storage.hpp>
#include <psx/worker.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

namespace wire = psx::detail::wire;

constexpr std::size_t table_rows = 1'000'000;
constexpr std::size_t num_ids = 100'000;

using psx_bench::zipf_ids;

const std::vector<std::uint64_t>& shared_ids() {
  static const std::vector<std::uint64_t> ids = zipf_ids(num_ids, table_rows, 1.1, 42);
  return ids;
}

std::vector<float> ramp(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
  return v;
}

// The reference every floor uses: one memcpy of `bytes` bytes between two
// buffers touched beforehand.
void memcpy_bytes(benchmark::State& state, std::size_t bytes, std::int64_t items) {
  std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes, std::byte{0});
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  if (items != 0) state.SetItemsProcessed(state.iterations() * items);
}

// -- 1. partitioner lookup -----------------------------------------------------

// A cluster with one worker and a sparse table placed by `p`, whose transport
// answers every request at once (the worker's side of a push, nothing else).
template <class P>
struct RowsCluster {
  psx::detail::ClusterCore core;
  std::size_t sent = 0;  // requests handed to the transport

  RowsCluster(const P& p, std::size_t num_servers, std::size_t width) {
    core.config.num_servers = num_servers;
    core.clocks.assign(1, 0);
    psx::VariableInfo v;
    v.meta = psx::detail::make_meta(psx::sparse("emb", table_rows, width), 0);
    v.shards = p.place(v.meta, num_servers);
    psx::detail::check_placement(v.meta, v.shards, num_servers);
    core.variables.push_back(std::move(v));
    core.by_name.emplace("emb", 0);
    core.send = [this](std::size_t, psx::Request&& r) {
      ++sent;
      r.finish();
    };
  }
  const psx::VariableInfo& variable() const { return core.variables[0]; }
};

template <class P>
void partition_shard_of_row(benchmark::State& state, P p, std::size_t num_servers) {
  const RowsCluster<P> c(p, num_servers, 16);
  const psx::VariableInfo& v = c.variable();
  const auto& ids = shared_ids();
  std::vector<std::uint32_t> shard_of(ids.size());
  for (auto _ : state) {
    for (std::size_t j = 0; j < ids.size(); ++j) shard_of[j] = static_cast<std::uint32_t>(v.shard_of_row(ids[j]));
    benchmark::DoNotOptimize(shard_of.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(ids.size()));
  state.counters["shards"] = static_cast<double>(v.shards.size());
}

template <class P>
void partition_worker_split(benchmark::State& state, P p, std::size_t num_servers) {
  RowsCluster<P> c(p, num_servers, 16);
  psx::Worker w(c.core, 0);
  const auto& ids = shared_ids();
  const std::vector<float> grads = ramp(ids.size() * 16);
  for (auto _ : state) {
    w.push_rows_async("emb", ids, grads).wait();
    benchmark::DoNotOptimize(c.sent);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(ids.size()));
  state.counters["shards"] = static_cast<double>(c.variable().shards.size());
  state.counters["requests"] =
      benchmark::Counter(static_cast<double>(c.sent) / static_cast<double>(state.iterations()));
}

void register_partition() {
  const std::string servers = "/servers:";
  auto both = [&](const std::string& name, auto p, std::size_t n) {
    benchmark::RegisterBenchmark(("BM_partition_shard_of_row/" + name + servers + std::to_string(n)).c_str(),
                                 [p, n](benchmark::State& s) { partition_shard_of_row(s, p, n); });
    benchmark::RegisterBenchmark(("BM_partition_worker_split/" + name + servers + std::to_string(n)).c_str(),
                                 [p, n](benchmark::State& s) { partition_worker_split(s, p, n); });
  };
  both("RowRange", psx::partition::RowRange{}, 8);
  both("RowRange", psx::partition::RowRange{}, 64);
  both("HashByName", psx::partition::HashByName{}, 8);
  both("RoundRobin", psx::partition::RoundRobin{}, 8);
  benchmark::RegisterBenchmark("BM_floor_memcpy_ids/100k", [](benchmark::State& s) {
    memcpy_bytes(s, num_ids * sizeof(std::uint64_t), static_cast<std::int64_t>(num_ids));
  });
}

// -- 2. wire encode / decode ---------------------------------------------------

// A request as a sender builds it, with the buffers it borrows.
struct WireCase {
  std::vector<std::uint64_t> ids;
  std::vector<float> in;
  psx::Request request;
  std::size_t payload = 0;  // bytes of the data frames

  // A push of `items` variables sharing `floats` floats between them.
  static WireCase dense(std::size_t floats, std::size_t items) {
    WireCase c;
    c.in = ramp(floats);
    c.request.op = psx::Op::push;
    const std::size_t per = floats / items;
    for (std::size_t i = 0; i < items; ++i) {
      psx::Item& item = c.request.items.emplace_back();
      item.variable = static_cast<std::uint32_t>(i);
      item.in = std::span<const float>(c.in).subspan(i * per, per);
    }
    c.payload = floats * sizeof(float);
    return c;
  }
  // A push_rows of `n` rows of `width` floats (one shard: no positions).
  static WireCase sparse(std::size_t n, std::size_t width) {
    WireCase c;
    c.ids.resize(n);
    for (std::size_t j = 0; j < n; ++j) c.ids[j] = (j * 999983u) % table_rows;
    c.in = ramp(n * width);
    c.request.op = psx::Op::push_rows;
    psx::Item& item = c.request.items.emplace_back();
    item.ids = c.ids;
    item.in = c.in;
    c.payload = n * sizeof(std::uint64_t) + n * width * sizeof(float);
    return c;
  }
};

// An encoded message: the header it owns and frames over the borrowed data.
struct Encoded {
  std::vector<std::byte> header;
  std::vector<wire::Segment> segments;
  std::vector<std::span<const std::byte>> frames;

  explicit Encoded(const psx::Request& r) {
    header = wire::encode_request(r, {1, 7, wire::max_chunk_bytes}, segments);
    frames.emplace_back(header);
    for (const auto& s : segments) frames.emplace_back(s.data, s.size);
  }
};

void wire_encode_request(benchmark::State& state, const WireCase& c) {
  const wire::RequestHead head{1, 7, wire::max_chunk_bytes};
  std::vector<wire::Segment> segments;
  std::size_t header_bytes = 0;
  for (auto _ : state) {
    segments.clear();  // a sender keeps its segment list's capacity
    auto header = wire::encode_request(c.request, head, segments);
    benchmark::DoNotOptimize(header.data());
    benchmark::DoNotOptimize(segments.data());
    benchmark::ClobberMemory();
    header_bytes = header.size();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(c.payload));
  state.counters["header_bytes"] = static_cast<double>(header_bytes);
}

void wire_decode_request(benchmark::State& state, const WireCase& c) {
  const Encoded e(c.request);
  const wire::Limits limits;
  // The in-place path is the one measured: aligned frames, one per tensor.
  if (!wire::decode_request(e.frames, limits, "bench").owned.empty()) {
    state.SkipWithError("decode copied a tensor: the frames should be aligned");
    return;
  }
  for (auto _ : state) {
    wire::Incoming in = wire::decode_request(e.frames, limits, "bench");
    benchmark::DoNotOptimize(in.request.items.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(c.payload));
}

// The floor of encode: a header of `bytes` bytes allocated and written once.
void floor_header(benchmark::State& state, std::size_t bytes, std::size_t payload) {
  for (auto _ : state) {
    std::vector<std::byte> h(bytes);
    benchmark::DoNotOptimize(h.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(payload));
}

// A reply carrying one tensor of `floats` floats (a pull's answer).
void wire_encode_reply(benchmark::State& state, std::size_t floats) {
  for (auto _ : state) {
    auto header = wire::encode_reply(1, wire::Status::ok, {}, 1, wire::max_chunk_bytes);
    benchmark::DoNotOptimize(header.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(floats * sizeof(float)));
}

void wire_decode_reply(benchmark::State& state, std::size_t floats) {
  const std::vector<float> values = ramp(floats);
  const auto header = wire::encode_reply(1, wire::Status::ok, {}, 1, wire::max_chunk_bytes);
  const std::span<const std::byte> frames[] = {header, std::as_bytes(std::span(values))};
  const wire::OutSpec outs[] = {{wire::OutKind::float32, floats}};
  for (auto _ : state) {
    wire::ReplyHead head = wire::decode_reply_head(frames[0], "bench");
    wire::check_reply_tensors(frames, outs, head.chunk, "bench");
    benchmark::DoNotOptimize(head);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(floats * sizeof(float)));
}

void register_wire() {
  constexpr std::size_t mib_floats = (std::size_t{1} << 20) / sizeof(float);
  constexpr std::size_t sparse_n = 10'000, sparse_width = 16;
  // Built once, before any benchmark runs; the lambdas borrow them.
  static const WireCase dense1 = WireCase::dense(mib_floats, 1);
  static const WireCase dense256 = WireCase::dense(mib_floats, 256);
  static const WireCase sparse = WireCase::sparse(sparse_n, sparse_width);
  const std::size_t mib = mib_floats * sizeof(float);
  auto header_of = [](const WireCase& c) { return Encoded(c.request).header.size(); };

  benchmark::RegisterBenchmark("BM_wire_encode_request/dense_1MiB/items:1",
                               [](benchmark::State& s) { wire_encode_request(s, dense1); });
  benchmark::RegisterBenchmark("BM_wire_encode_request/dense_1MiB/items:256",
                               [](benchmark::State& s) { wire_encode_request(s, dense256); });
  for (const auto& [c, items] : {std::pair{&dense1, 1}, std::pair{&dense256, 256}}) {
    const std::size_t h = header_of(*c);
    benchmark::RegisterBenchmark(
        ("BM_floor_header/dense_1MiB/items:" + std::to_string(items) + "/" + std::to_string(h) + "B").c_str(),
        [h, mib](benchmark::State& s) { floor_header(s, h, mib); });
  }
  benchmark::RegisterBenchmark("BM_wire_decode_request/dense_1MiB/items:1",
                               [](benchmark::State& s) { wire_decode_request(s, dense1); });
  benchmark::RegisterBenchmark("BM_wire_decode_request/dense_1MiB/items:256",
                               [](benchmark::State& s) { wire_decode_request(s, dense256); });
  benchmark::RegisterBenchmark("BM_wire_encode_reply/dense_1MiB",
                               [](benchmark::State& s) { wire_encode_reply(s, mib_floats); });
  benchmark::RegisterBenchmark("BM_wire_decode_reply/dense_1MiB",
                               [](benchmark::State& s) { wire_decode_reply(s, mib_floats); });
  benchmark::RegisterBenchmark("BM_floor_memcpy_payload/1MiB",
                               [mib](benchmark::State& s) { memcpy_bytes(s, mib, 0); });

  const std::size_t h = header_of(sparse);
  benchmark::RegisterBenchmark("BM_wire_encode_request/sparse_10k_x16",
                               [](benchmark::State& s) { wire_encode_request(s, sparse); });
  benchmark::RegisterBenchmark(("BM_floor_header/sparse_10k_x16/" + std::to_string(h) + "B").c_str(),
                               [h](benchmark::State& s) { floor_header(s, h, sparse.payload); });
  benchmark::RegisterBenchmark("BM_wire_decode_request/sparse_10k_x16",
                               [](benchmark::State& s) { wire_decode_request(s, sparse); });
  benchmark::RegisterBenchmark("BM_floor_memcpy_payload/sparse_10k_x16_ids+rows",
                               [](benchmark::State& s) { memcpy_bytes(s, sparse.payload, 0); });
  benchmark::RegisterBenchmark("BM_wire_encode_reply/sparse_10k_x16",
                               [](benchmark::State& s) { wire_encode_reply(s, sparse_n * sparse_width); });
  benchmark::RegisterBenchmark("BM_wire_decode_reply/sparse_10k_x16",
                               [](benchmark::State& s) { wire_decode_reply(s, sparse_n * sparse_width); });
  benchmark::RegisterBenchmark("BM_floor_memcpy_payload/sparse_10k_x16_rows", [](benchmark::State& s) {
    memcpy_bytes(s, sparse_n * sparse_width * sizeof(float), 0);
  });
}

// -- 3. summing repeated ids ---------------------------------------------------

void dedup_counters(benchmark::State& state, std::size_t width, std::size_t distinct) {
  const auto& ids = shared_ids();
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(ids.size()));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(ids.size() * width * sizeof(float)));
  if (distinct != 0) state.counters["distinct"] = static_cast<double>(distinct);
}

// A fresh accumulator per request, one `add` per id.
void dedup_row_accumulator(benchmark::State& state, std::size_t width) {
  const auto& ids = shared_ids();
  const std::vector<float> grads = ramp(ids.size() * width);
  std::size_t distinct = 0;
  for (auto _ : state) {
    psx::detail::RowAccumulator acc(width);
    for (std::size_t j = 0; j < ids.size(); ++j) acc.add(ids[j], grads.data() + j * width);
    benchmark::DoNotOptimize(acc.data().data());
    benchmark::ClobberMemory();
    distinct = acc.rows().size();
  }
  dedup_counters(state, width, distinct);
}

void dedup_row_accumulator_reused(benchmark::State& state, std::size_t width) {
  const auto& ids = shared_ids();
  const std::vector<float> grads = ramp(ids.size() * width);
  psx::detail::RowAccumulator acc(width);
  for (auto _ : state) {
    acc.reset(width);
    for (std::size_t j = 0; j < ids.size(); ++j) acc.add(ids[j], grads.data() + j * width);
    benchmark::DoNotOptimize(acc.data().data());
    benchmark::ClobberMemory();
  }
  dedup_counters(state, width, acc.rows().size());
}

void ref_sort_unique(benchmark::State& state, std::size_t width) {
  const auto& ids = shared_ids();
  std::vector<std::uint64_t> scratch;
  std::size_t distinct = 0;
  for (auto _ : state) {
    scratch.assign(ids.begin(), ids.end());
    std::sort(scratch.begin(), scratch.end());
    distinct = static_cast<std::size_t>(std::unique(scratch.begin(), scratch.end()) - scratch.begin());
    benchmark::DoNotOptimize(scratch.data());
    benchmark::ClobberMemory();
  }
  dedup_counters(state, width, distinct);
}

void register_dedup() {
  for (const std::size_t width : {std::size_t{16}, std::size_t{64}}) {
    const std::string dim = "/dim:" + std::to_string(width);
    benchmark::RegisterBenchmark(("BM_dedup_row_accumulator" + dim).c_str(),
                                 [width](benchmark::State& s) { dedup_row_accumulator(s, width); });
    benchmark::RegisterBenchmark(("BM_dedup_row_accumulator_reused" + dim).c_str(),
                                 [width](benchmark::State& s) { dedup_row_accumulator_reused(s, width); });
    benchmark::RegisterBenchmark(("BM_ref_sort_unique_ids" + dim).c_str(),
                                 [width](benchmark::State& s) { ref_sort_unique(s, width); });
    benchmark::RegisterBenchmark(("BM_floor_memcpy_grad" + dim).c_str(), [width](benchmark::State& s) {
      memcpy_bytes(s, num_ids * width * sizeof(float), static_cast<std::int64_t>(num_ids));
    });
  }
}

template <class P>
void place_variables(benchmark::State& state, P partitioner, std::size_t vars, std::size_t servers,
                     std::size_t shards) {
  for (auto _ : state) {
    psx::ParameterServer<P, psx::sync::Asynchronous, psx::optim::SGD> ps({servers, 1}, partitioner);
    std::string name;
    for (std::size_t k = 0; k < vars; ++k) {
      name.assign(1, 'v').append(std::to_string(k));  // (GCC 12 warns, falsely, on "v" + std::to_string(k))
      ps.declare(psx::dense(name, {std::max<std::size_t>(shards, 64 + k % 1000), 4}));
    }
    benchmark::DoNotOptimize(ps.placement().bytes.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * vars));
}

void register_place() {
  struct Case {
    std::size_t vars, servers, shards;
  };
  for (const Case c : {Case{20000, 8, 1}, Case{1000, 1000, 1000}}) {
    const std::string name = "/vars:" + std::to_string(c.vars) + "/servers:" + std::to_string(c.servers) +
                             "/shards:" + std::to_string(c.shards);
    benchmark::RegisterBenchmark(("BM_place_least_loaded" + name).c_str(), [c](benchmark::State& s) {
      place_variables(s, psx::partition::LeastLoaded<psx::partition::FixedShards>{{c.shards}}, c.vars, c.servers,
                      c.shards);
    })->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_ref_place_fixed" + name).c_str(), [c](benchmark::State& s) {
      place_variables(s, psx::partition::FixedShards{c.shards}, c.vars, c.servers, c.shards);
    })->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_partition();
  register_wire();
  register_dedup();
  register_place();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
