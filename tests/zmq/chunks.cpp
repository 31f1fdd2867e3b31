// Tensors split into chunks (docs/wire.md "Large tensors"), cheaply: chunks
// of 1 MiB + 3 bytes, so that floats, 16-bit values, 64-bit ids and rows
// straddle frame boundaries, over ZeroMQ (every task a thread of this
// process), bit for bit as in one process. The same code moves a tensor of
// 2^32 bytes in frames of 2^31 - 1 (tests/core/big_tensors.cpp, gated).
#include "../support.hpp"
#include "tasks.hpp"

#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

using psx::transport::Zmq;

constexpr std::uint32_t kChunk = (1u << 20) + 3;
constexpr std::size_t kDense = 1'000'003;                // 2 shards of about 2 MB: 2 frames each, floats split
constexpr std::size_t kHalf = 1'500'001;                 // bfloat16: 16-bit pulls of 1.5 MB, values split
constexpr std::size_t kWideRows = 3000, kWide = 1001;    // rows of 4004 bytes across frames
constexpr std::size_t kTallRows = 400'000, kTall = 2;    // 200k ids: 1.6 MB of ids, split
constexpr std::size_t kWideIds = 700, kTallIds = 200'000;

// Element i's bits, unique per index (finite, normal): a misplaced frame,
// a byte lost where a frame splits a value, or a row in another's place
// shows.
float pattern(std::uint64_t i, std::uint32_t salt) {
  const auto bits = static_cast<std::uint32_t>(((64 + ((i >> 23) & 127) + salt) << 23) | (i & 0x7fffff));
  return std::bit_cast<float>(bits);
}

template <class PS>
void declare(PS& ps) {
  ps.declare({.name = "dense", .shape = {kDense}, .init = psx::Initializer::uniform(-1.0f, 1.0f, 5)});
  ps.declare({.name = "half", .shape = {kHalf}, .init = psx::Initializer::uniform(-1.0f, 1.0f, 6),
              .dtype = psx::DType::bfloat16});
  ps.declare({.name = "wide", .shape = {kWideRows, kWide}, .kind = psx::VariableKind::sparse,
              .init = psx::Initializer::normal(0.0f, 0.1f, 7)});
  ps.declare({.name = "tall", .shape = {kTallRows, kTall}, .kind = psx::VariableKind::sparse,
              .init = psx::Initializer::normal(0.0f, 0.1f, 8)});
}

// What the chief reads back: every tensor as it travelled, as bits.
using Result = std::map<std::string, std::vector<std::uint32_t>>;

template <class T>
std::vector<std::uint32_t> bits_of(const std::vector<T>& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (sizeof(T) == 4) out[i] = std::bit_cast<std::uint32_t>(v[i]);
    else out[i] = static_cast<std::uint32_t>(std::bit_cast<std::uint16_t>(v[i]));
  }
  return out;
}

// Two steps of pushes (SGD, lr 1: the parameters move by the patterns) and
// the pulls after them; ids in an order that spreads every call over both
// servers, some repeated (their gradients add up).
void train(psx::Worker& w, Result& out) {
  std::vector<std::uint64_t> wide_ids(kWideIds), tall_ids(kTallIds);
  for (std::size_t k = 0; k < kWideIds; ++k) wide_ids[k] = (k * 1237 + 11) % kWideRows;
  for (std::size_t k = 0; k < kTallIds; ++k) tall_ids[k] = (k * 7919 + 3) % kTallRows;
  wide_ids[kWideIds - 1] = wide_ids[0];
  tall_ids[kTallIds - 1] = tall_ids[1];
  for (std::uint32_t t = 0; t < 2; ++t) {
    std::vector<float> g(kDense), gh(kHalf), gw(kWideIds * kWide), gt(kTallIds * kTall);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = pattern(i, t);
    for (std::size_t i = 0; i < gh.size(); ++i) gh[i] = pattern(i, t + 2);
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = pattern(i, t + 4);
    for (std::size_t i = 0; i < gt.size(); ++i) gt[i] = pattern(i, t + 6);
    w.push("dense", g);
    w.push("half", gh);
    w.push_rows("wide", wide_ids, gw);
    w.push_rows("tall", tall_ids, gt);
    w.step();
  }
  std::vector<float> dense(kDense), half32(kHalf), wide(kWideIds * kWide), tall(kTallIds * kTall);
  std::vector<psx::bfloat16> half(kHalf);
  w.pull("dense", dense);
  w.pull("half", half32);
  w.pull("half", std::span<psx::bfloat16>(half));
  w.pull_rows("wide", wide_ids, wide);
  w.pull_rows("tall", tall_ids, tall);
  out = {{"dense", bits_of(dense)}, {"half", bits_of(half32)}, {"half16", bits_of(half)},
         {"wide", bits_of(wide)},   {"tall", bits_of(tall)}};
}

Result run_inprocess() {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> ps({2, 1}, {}, {},
                                                                                              psx::optim::SGD{1.0});
  declare(ps);
  Result out;
  ps.run([&](psx::Worker& w) { train(w, out); });
  return out;
}

Result run_zmq(std::uint32_t chunk) {
  Result out;
  psx_zmq_test::for_each_task(2, 1, false, [&](const std::string&, std::size_t, Zmq z) {
    z.chunk_bytes = chunk;
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD, Zmq> ps(
        {2, 1, std::chrono::milliseconds(20000)}, {}, {}, psx::optim::SGD{1.0}, z);
    declare(ps);
    ps.run([&](psx::Worker& w) { train(w, out); });  // only the chief's runs
  });
  return out;
}

}  // namespace

TEST_CASE("zmq: tensors in chunks of 1 MiB + 3 bytes, values, 16-bit values, ids and rows split across frames, equal the in-process cluster bit for bit") {
  psx_test::Watchdog dog("zmq chunks", std::chrono::seconds(120));
  const Result local = run_inprocess();
  const Result zmq = run_zmq(kChunk);
  REQUIRE(zmq.size() == local.size());
  for (const auto& [name, bits] : local) {
    INFO("tensor " << name);
    const auto& got = zmq.at(name);
    REQUIRE(got.size() == bits.size());
    std::size_t first_bad = bits.size();
    for (std::size_t i = 0; i < bits.size() && first_bad == bits.size(); ++i)
      if (got[i] != bits[i]) first_bad = i;
    CHECK(first_bad == bits.size());
  }
  // And the pushes moved the parameters: dense element i is its initial
  // value minus the two patterns.
  psx::Initializer init = psx::Initializer::uniform(-1.0f, 1.0f, 5);
  for (const std::size_t i : {std::size_t{0}, std::size_t{262144}, kDense / 2, kDense - 1}) {
    const float want = (init.value("dense", i) - pattern(i, 0)) - pattern(i, 1);
    CHECK(std::bit_cast<std::uint32_t>(want) == zmq.at("dense")[i]);
  }
}

TEST_CASE("wire: a tensor joined from chunks lets go of each frame once copied, and only then") {
  // A push of 1001 floats and 3 ids in chunks of 7 bytes: every tensor
  // joined (several frames), each frame reported once, in order, after
  // its bytes were copied (the frames are overwritten as they are let go).
  std::vector<float> g(1001);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = pattern(i, 9);
  const std::vector<std::uint64_t> ids = {5, 1ull << 40, 7};
  psx::Request r;
  r.op = psx::Op::push_rows;
  psx::Item item;
  item.ids = ids;
  item.in = g;
  r.items.push_back(item);
  psx::detail::wire::RequestHead head{1, 42, 7};
  std::vector<psx::detail::wire::Segment> segs;
  const auto header = psx::detail::wire::encode_request(r, head, segs);
  std::vector<std::vector<std::byte>> frames = {header};
  for (const auto& s : segs) frames.emplace_back(s.data, s.data + s.size);
  CHECK(frames.size() == 1 + (24 + 6) / 7 + (4004 + 6) / 7);
  std::vector<std::span<const std::byte>> spans(frames.begin(), frames.end());
  std::vector<std::size_t> released;
  const auto in = psx::detail::wire::decode_request(spans, {}, "test", [&](std::size_t k, std::size_t from, std::size_t to) {
    CHECK(from == 0);  // frames under release_step go in one piece
    CHECK(to == frames[k].size());
    released.push_back(k);
    std::memset(frames[k].data() + from, 0xee, to - from);  // what a page let go of may hold
  });
  std::vector<std::size_t> want(frames.size() - 1);
  std::iota(want.begin(), want.end(), std::size_t{1});
  CHECK(released == want);
  REQUIRE(in.request.items.size() == 1);
  CHECK(std::vector<std::uint64_t>(in.request.items[0].ids.begin(), in.request.items[0].ids.end()) == ids);
  REQUIRE(in.request.items[0].in.size() == g.size());
  CHECK(std::memcmp(in.request.items[0].in.data(), g.data(), g.size() * 4) == 0);
  // A tensor in one aligned frame is used where it lies: nothing let go.
  released.clear();
  head.chunk = psx::detail::wire::max_chunk_bytes;
  segs.clear();
  const auto whole = psx::detail::wire::encode_request(r, head, segs);
  std::vector<std::span<const std::byte>> direct = {std::span<const std::byte>(whole)};
  for (const auto& s : segs) direct.emplace_back(s.data, s.size);
  const auto in2 = psx::detail::wire::decode_request(direct, {}, "test",
                                                     [&](std::size_t k, std::size_t, std::size_t) { released.push_back(k); });
  CHECK(released.empty());
  CHECK(in2.request.items[0].in.data() == g.data());
}

TEST_CASE("wire: a large frame is copied out in steps, each let go of as it is copied") {
  // One frame of 2.5 release steps (plus a byte, so that the float the
  // chunk ends in is split): its bytes are reported in order, in steps,
  // the last to its end; a step's bytes are not read after it is reported.
  const std::size_t step = psx::detail::wire::release_step;
  const std::size_t floats = (5 * step / 2) / 4 + 1;
  std::vector<float> g(floats);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = pattern(i, 3);
  psx::Request r;
  r.op = psx::Op::push;
  psx::Item item;
  item.in = g;
  r.items.push_back(item);
  const psx::detail::wire::RequestHead head{1, 42, static_cast<std::uint32_t>(floats * 4 - 1)};
  std::vector<psx::detail::wire::Segment> segs;
  const auto header = psx::detail::wire::encode_request(r, head, segs);
  REQUIRE(segs.size() == 2);
  std::vector<std::vector<std::byte>> frames = {header};
  for (const auto& s : segs) frames.emplace_back(s.data, s.data + s.size);
  std::vector<std::span<const std::byte>> spans(frames.begin(), frames.end());
  std::vector<std::array<std::size_t, 3>> seen;
  const auto in = psx::detail::wire::decode_request(spans, {}, "test", [&](std::size_t k, std::size_t from, std::size_t to) {
    seen.push_back({k, from, to});
    std::memset(frames[k].data() + from, 0xee, to - from);
  });
  const std::size_t big = floats * 4 - 1;
  const std::vector<std::array<std::size_t, 3>> want = {
      {1, 0, step}, {1, step, 2 * step}, {1, 2 * step, big}, {2, 0, 1}};
  CHECK(seen == want);
  REQUIRE(in.request.items[0].in.size() == floats);
  CHECK(std::memcmp(in.request.items[0].in.data(), g.data(), floats * 4) == 0);
}
