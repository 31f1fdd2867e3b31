// Fuzz target for the wire decoders (psx/detail/wire.hpp): whatever the bytes,
// a decoder returns a message whose spans lie inside what it was given, or
// throws psx::wire_error; never a crash, an overrun or a huge allocation.
//
// With clang: -fsanitize=fuzzer,address,undefined -DPSX_LIBFUZZER gives a
// libFuzzer binary (cmake -DPSX_FUZZ=ON, docs/wire.md says how to run it).
// Without it, this file builds a standalone driver that runs a fixed number of
// mutated well-formed messages and random inputs through the same entry
// point (a ctest test), and can write a seed corpus: --write-corpus DIR.
#include <psx/detail/wire.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace wire = psx::detail::wire;

namespace {

// The input's bytes as frames: byte 0 gives the frame count (1 to 8), each
// frame but the last is preceded by a 16-bit little-endian length.
std::vector<std::span<const std::byte>> split(std::span<const std::byte> in) {
  std::vector<std::span<const std::byte>> frames;
  if (in.empty()) return frames;
  const std::size_t n = static_cast<std::size_t>(in[0]) % 8 + 1;
  std::size_t at = 1;
  for (std::size_t k = 0; k + 1 < n && at + 2 <= in.size(); ++k) {
    std::size_t len = static_cast<std::size_t>(in[at]) | static_cast<std::size_t>(in[at + 1]) << 8;
    at += 2;
    len = std::min(len, in.size() - at);
    frames.push_back(in.subspan(at, len));
    at += len;
  }
  frames.push_back(in.subspan(std::min(at, in.size())));
  return frames;
}

bool inside(const void* p, std::size_t bytes, std::span<const std::span<const std::byte>> frames,
            const wire::Incoming& in) {
  if (bytes == 0) return true;
  const auto* b = static_cast<const std::byte*>(p);
  for (const auto& f : frames)
    if (b >= f.data() && b + bytes <= f.data() + f.size()) return true;
  for (const auto& o : in.owned)
    if (b >= reinterpret_cast<const std::byte*>(o.get())) return true;  // a joined copy the decoder made
  return false;
}

void run_one(std::span<const std::byte> data) {
  const auto frames = split(data);
  if (frames.empty()) return;
  wire::Limits limits;
  limits.max_message_bytes = 1 << 20;
  try {
    const wire::Incoming in = wire::decode_request(frames, limits, "fuzz");
    for (const psx::Item& item : in.request.items)
      if (!inside(item.ids.data(), item.ids.size_bytes(), frames, in) ||
          !inside(item.in.data(), item.in.size_bytes(), frames, in))
        std::abort();  // a span outside the message: a decoder bug
  } catch (const psx::wire_error&) {
  }
  try {
    const wire::ReplyHead h = wire::decode_reply_head(frames[0], "fuzz");
    // Expect one tensor per following frame of the sizes found there.
    std::vector<wire::OutSpec> outs;
    for (std::size_t k = 1; k < frames.size(); ++k) outs.push_back({wire::OutKind::bits16, frames[k].size() / 2});
    wire::check_reply_tensors(frames, outs, h.chunk, "fuzz");
  } catch (const psx::wire_error&) {
  }
  try {
    (void)wire::decode_hello(frames[0], "fuzz");
  } catch (const psx::wire_error&) {
  }
  try {
    (void)wire::decode_refuse(frames[0], "fuzz");
  } catch (const psx::wire_error&) {
  }
  try {
    (void)wire::decode_signal(frames[0], "fuzz");
  } catch (const psx::wire_error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_one({reinterpret_cast<const std::byte*>(data), size});
  return 0;
}

#ifndef PSX_LIBFUZZER
namespace {

// One message in the input format above.
std::vector<std::byte> join(const std::vector<std::byte>& header, const std::vector<wire::Segment>& segs) {
  std::vector<std::byte> in;
  in.push_back(static_cast<std::byte>(segs.size()));  // frame count - 1
  auto frame = [&](const std::byte* p, std::size_t n, bool last) {
    if (!last) {
      in.push_back(static_cast<std::byte>(n & 0xff));
      in.push_back(static_cast<std::byte>(n >> 8));
    }
    in.insert(in.end(), p, p + n);
  };
  frame(header.data(), header.size(), segs.empty());
  for (std::size_t k = 0; k < segs.size(); ++k) frame(segs[k].data, segs[k].size, k + 1 == segs.size());
  return in;
}

// Well-formed messages of every kind: the seeds mutations start from.
std::vector<std::vector<std::byte>> seeds() {
  static const std::vector<float> grad(40, 0.5f);
  static std::vector<float> out(40);
  static const std::vector<std::uint64_t> ids = {1, 5, 9};
  static const std::vector<std::uint64_t> page_ask = {4, 17, 99, 3};  // an export page's words
  std::vector<std::vector<std::byte>> all;
  for (psx::Op op : {psx::Op::push, psx::Op::pull, psx::Op::push_rows, psx::Op::pull_rows, psx::Op::clock,
                     psx::Op::cancel, psx::Op::table_stats, psx::Op::table_export}) {
    const bool no_item = op == psx::Op::clock || op == psx::Op::cancel;
    psx::Request r;
    r.op = op;
    r.worker = 1;
    r.clock = 3;
    r.reason = no_item ? "" : "x";
    psx::Item item;
    if (op == psx::Op::push) item.in = grad;
    if (op == psx::Op::pull) item.out = out;
    if (op == psx::Op::push_rows || op == psx::Op::pull_rows) item.ids = ids;
    if (op == psx::Op::push_rows) item.in = std::span<const float>(grad).first(12);
    if (op == psx::Op::pull_rows) item.out = std::span<float>(out).first(12);
    if (op == psx::Op::table_stats) item.out = std::span<float>(out).first(18);
    if (op == psx::Op::table_export) {
      item.ids = page_ask;
      item.out = std::span<float>(out).first(16 + 2 * (2 + 3));
    }
    if (!no_item) r.items.push_back(item);
    for (std::uint32_t chunk : {64u, 4096u}) {
      std::vector<wire::Segment> segs;
      const auto h = wire::encode_request(r, {7, 99, chunk}, segs);
      all.push_back(join(h, segs));
    }
  }
  const std::vector<wire::Segment> reply_tensor = {{reinterpret_cast<const std::byte*>(grad.data()), 48}};
  all.push_back(join(wire::encode_reply(7, wire::Status::ok, {}, 1, 4096), reply_tensor));
  all.push_back(join(wire::encode_reply(8, wire::Status::shape_error, "psx: bad", 0, 4096), {}));
  all.push_back(join(wire::encode_hello({99, 1, 2, 3}), {}));
  all.push_back(join(wire::encode_refuse(wire::Status::config_error, "psx: no"), {}));
  all.push_back(join(wire::encode_signal(wire::Kind::pong, 1), {}));
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  const auto all = seeds();
  if (argc == 3 && std::string(argv[1]) == "--write-corpus") {
    for (std::size_t k = 0; k < all.size(); ++k) {
      std::ofstream f(std::string(argv[2]) + "/seed-" + std::to_string(k), std::ios::binary);
      f.write(reinterpret_cast<const char*>(all[k].data()), static_cast<std::streamsize>(all[k].size()));
    }
    std::printf("wrote %zu seeds to %s\n", all.size(), argv[2]);
    return 0;
  }
  const long runs = argc == 2 ? std::atol(argv[1]) : 200000;
  std::mt19937_64 rng(7);
  for (const auto& s : all) run_one(s);
  for (long k = 0; k < runs; ++k) {
    std::vector<std::byte> in;
    if (k % 8 == 0) {  // random bytes
      in.resize(rng() % 300);
      for (auto& b : in) b = static_cast<std::byte>(rng());
    } else {  // a seed with some bytes changed, cut or extended
      in = all[rng() % all.size()];
      for (int f = 0, n = 1 + static_cast<int>(rng() % 6); f < n && !in.empty(); ++f)
        in[rng() % in.size()] = static_cast<std::byte>(rng());
      if (rng() % 4 == 0) in.resize(rng() % (in.size() + 1));
      if (rng() % 4 == 0) in.resize(in.size() + rng() % 64, static_cast<std::byte>(rng()));
    }
    run_one(in);
  }
  std::printf("wire decoders: %zu seeds and %ld mutated or random inputs decoded or refused with wire_error\n",
              all.size(), runs);
  return 0;
}
#endif
