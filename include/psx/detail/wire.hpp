//! @file psx/detail/wire.hpp
//! The psx wire format (docs/wire.md): how a Request and its reply travel
//! between processes as a list of frames. Pure functions over bytes, with no
//! ZeroMQ in sight, so the decoders can be fuzzed on their own.
//!
//! Everything is little-endian; every length and count is checked against
//! the bytes actually received and against the limits before it is used, and
//! a message that fails a check raises `psx::wire_error` saying what and where.
#pragma once

#include <psx/errors.hpp>
#include <psx/message.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail::wire {

static_assert(std::endian::native == std::endian::little,
              "psx: the wire format is little-endian and psx copies tensors as they lie in memory; "
              "big-endian hosts are not supported");

//! "PSXW" as the first four bytes of every header frame.
inline constexpr std::uint32_t magic = 0x57585350u;
//! Bumped whenever a layout below changes, or what a message asks of its
//! peer; peers of another version are refused at the handshake. 4: a join
//! carries one item of 2 floats, answered with the clock the server counts
//! the worker at. 5: the table operations (Op::table_stats, table_export).
inline constexpr std::uint16_t version = 5;
//! Largest frame a sender makes: tensors above it are split into chunks.
inline constexpr std::uint32_t max_chunk_bytes = 0x7fffffffu;  // 2 GiB - 1

//! What a header frame is. The first 8 bytes of every header (magic,
//! version, kind, one byte) keep this layout in every version, so that a
//! peer can always read another's version and say which it is.
enum class Kind : std::uint8_t {
  hello = 1,    //!< worker -> server: who I am (first message; answered)
  welcome = 2,  //!< server -> worker: hello accepted
  refuse = 3,   //!< server -> worker: hello or request refused, with why
  request = 4,  //!< worker -> server: a Request (answered when `call != 0`)
  reply = 5,    //!< server -> worker: the answer to a request
  pong = 6,     //!< server -> worker: the server is alive (answers heartbeats)
  stop = 7,     //!< chief -> server: the cluster is done, stop serving
};

//! The error types a reply can carry; the worker rethrows the same type.
enum class Status : std::uint8_t {
  ok = 0,
  error = 1,
  unknown_variable = 2,
  duplicate_variable = 3,
  shape_error = 4,
  row_out_of_range = 5,
  frozen_variable = 6,
  shutdown_error = 7,
  config_error = 8,
  sync_error = 9,
  wire_error = 10,
  checkpoint_error = 11,
  peer_lost = 12,
};

//! What a reply tensor holds.
enum class OutKind : std::uint8_t { none = 0, float32 = 1, bits16 = 2 };

//! Bounds a receiver enforces before it allocates or trusts anything.
struct Limits {
  //! Largest message (all frames) accepted: checked once it is received
  //! (answered with a wire_error); the socket bounds each frame by the
  //! largest chunk, 2 GiB, whatever this says.
  std::uint64_t max_message_bytes = std::uint64_t{16} << 30;
  //! Most items in one request.
  std::uint32_t max_items = 1u << 20;
  //! Longest reason / error text.
  std::uint32_t max_text_bytes = 1u << 16;
  friend bool operator==(const Limits&, const Limits&) = default;
};

inline constexpr std::size_t prefix_bytes = 8;
inline constexpr std::size_t hello_bytes = 40;
inline constexpr std::size_t request_fixed_bytes = 80;
inline constexpr std::size_t item_bytes = 40;
inline constexpr std::size_t reply_fixed_bytes = 32;

// -- little-endian byte access ----------------------------------------------

template <class T>
void put(std::vector<std::byte>& out, std::size_t at, T value) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(out.data() + at, &value, sizeof(T));
}

template <class T>
T get(std::span<const std::byte> in, std::size_t at) noexcept {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

//! The frozen first 8 bytes of a header frame.
struct Prefix {
  std::uint16_t version = 0;
  Kind kind{};
  std::uint8_t byte7 = 0;
};

inline std::vector<std::byte> make_header(std::size_t size, Kind kind, std::uint8_t byte7 = 0) {
  std::vector<std::byte> h(size);
  put(h, 0, magic);
  put(h, 4, version);
  put(h, 6, static_cast<std::uint8_t>(kind));
  put(h, 7, byte7);
  return h;
}

//! Reads the prefix; throws wire_error for a short frame or a bad magic. The
//! version is returned as found: callers decide what another version means.
inline Prefix read_prefix(std::span<const std::byte> frame, std::string_view where) {
  if (frame.size() < prefix_bytes)
    throw wire_error("psx: " + std::string(where) + ": a " + std::to_string(frame.size()) +
                     "-byte frame is too short for a psx header (8 bytes at least)");
  if (get<std::uint32_t>(frame, 0) != magic)
    throw wire_error("psx: " + std::string(where) + ": not a psx message (bad magic)");
  Prefix p;
  p.version = get<std::uint16_t>(frame, 4);
  p.kind = static_cast<Kind>(get<std::uint8_t>(frame, 6));
  p.byte7 = get<std::uint8_t>(frame, 7);
  return p;
}

inline std::string version_text(std::uint16_t v) { return "psx wire version " + std::to_string(v); }

// -- checked arithmetic ------------------------------------------------------

// a * b, or wire_error when it overflows 64 bits.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, std::string_view where) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw wire_error("psx: " + std::string(where) + ": a size overflows 64 bits (" + std::to_string(a) + " x " +
                     std::to_string(b) + ")");
  return r;
}

//! Number of frames a tensor of `bytes` bytes is sent in (no overflow for
//! any 64-bit size).
inline std::uint64_t chunks(std::uint64_t bytes, std::uint32_t chunk) noexcept {
  return bytes / chunk + (bytes % chunk != 0);
}

// -- hello / welcome / refuse / pong / stop ----------------------------------

//! A worker introducing itself to a server.
struct Hello {
  std::uint64_t fingerprint = 0;
  std::uint32_t worker = 0;
  std::uint32_t num_workers = 0;
  std::uint32_t num_servers = 0;
  //! The sender process's incarnation (a random number, not 0, drawn when
  //! it connects); 0: a sender that does not number its requests.
  std::uint64_t process = 0;
};

inline std::vector<std::byte> encode_hello(const Hello& h) {
  auto out = make_header(hello_bytes, Kind::hello);
  put(out, 8, h.fingerprint);
  put(out, 16, h.worker);
  put(out, 20, h.num_workers);
  put(out, 24, h.num_servers);
  put(out, 28, std::uint32_t{0});
  put(out, 32, h.process);
  return out;
}

//! Decodes a hello of this version (check the prefix's version first).
inline Hello decode_hello(std::span<const std::byte> frame, std::string_view where) {
  if (frame.size() != hello_bytes)
    throw wire_error("psx: " + std::string(where) + ": a hello is " + std::to_string(hello_bytes) + " bytes, got " +
                     std::to_string(frame.size()));
  Hello h;
  h.fingerprint = get<std::uint64_t>(frame, 8);
  h.worker = get<std::uint32_t>(frame, 16);
  h.num_workers = get<std::uint32_t>(frame, 20);
  h.num_servers = get<std::uint32_t>(frame, 24);
  h.process = get<std::uint64_t>(frame, 32);
  return h;
}

//! A stop (kind 7, chief -> server): the cluster's fingerprint and the
//! chief process's incarnation, 24 bytes.
inline std::vector<std::byte> encode_stop(std::uint64_t fingerprint, std::uint64_t process) {
  auto out = make_header(24, Kind::stop);
  put(out, 8, fingerprint);
  put(out, 16, process);
  return out;
}
struct Stop {
  std::uint64_t fingerprint = 0;
  std::uint64_t process = 0;
};
inline Stop decode_stop(std::span<const std::byte> frame, std::string_view where) {
  if (frame.size() != 24)
    throw wire_error("psx: " + std::string(where) + ": a stop is 24 bytes, got " + std::to_string(frame.size()));
  return {get<std::uint64_t>(frame, 8), get<std::uint64_t>(frame, 16)};
}

//! welcome, pong and stop: the prefix and one 64-bit word (docs/wire.md: a
//! server's incarnation in a welcome and a pong, the chief's cluster fingerprint in a stop).
inline std::vector<std::byte> encode_signal(Kind kind, std::uint64_t word) {
  auto out = make_header(16, kind);
  put(out, 8, word);
  return out;
}

inline std::uint64_t decode_signal(std::span<const std::byte> frame, std::string_view where) {
  if (frame.size() != 16)
    throw wire_error("psx: " + std::string(where) + ": a signal frame is 16 bytes, got " +
                     std::to_string(frame.size()));
  return get<std::uint64_t>(frame, 8);
}

//! A refusal: this side's version in the prefix and the error's Status in
//! its last byte, then u32 length and text. Its layout is frozen, so that
//! any version can read any other's refusal.
inline std::vector<std::byte> encode_refuse(Status status, std::string_view why) {
  const std::size_t n = std::min<std::size_t>(why.size(), 1u << 16);
  auto out = make_header(12 + n, Kind::refuse, static_cast<std::uint8_t>(status));
  put(out, 8, static_cast<std::uint32_t>(n));
  if (n != 0) std::memcpy(out.data() + 12, why.data(), n);
  return out;
}

inline std::string decode_refuse(std::span<const std::byte> frame, std::string_view where) {
  if (frame.size() < 12 || get<std::uint32_t>(frame, 8) != frame.size() - 12)
    throw wire_error("psx: " + std::string(where) + ": a malformed refusal (" + std::to_string(frame.size()) +
                     " bytes)");
  return std::string(reinterpret_cast<const char*>(frame.data()) + 12, frame.size() - 12);
}

// -- requests ----------------------------------------------------------------

//! A piece of memory to send as (part of) a frame; borrowed, not owned.
struct Segment {
  const std::byte* data = nullptr;
  std::size_t size = 0;
};

//! One tensor of a request or reply as it travels: `bytes` long, split into
//! frames of `chunk` bytes (the last one shorter).
inline void add_tensor(std::vector<Segment>& out, const void* data, std::uint64_t bytes, std::uint32_t chunk) {
  const auto* p = static_cast<const std::byte*>(data);
  for (std::uint64_t at = 0; at < bytes; at += chunk)
    out.push_back({p + at, static_cast<std::size_t>(std::min<std::uint64_t>(chunk, bytes - at))});
}

//! What the receiver of a request learns besides the Request itself.
struct RequestHead {
  std::uint64_t call = 0;  //!< 0: no reply wanted; else the sender's sequence number for it
  std::uint64_t fingerprint = 0;
  std::uint32_t chunk = max_chunk_bytes;
  //! The lowest call the sender still waits on from this server: the
  //! server may forget what it remembers of calls below it.
  std::uint64_t floor = 0;
  //! The server incarnation the sender addresses (from its welcome); 0:
  //! any. A server of another incarnation refuses the request unexecuted.
  std::uint64_t incarnation = 0;
  //! Sent again (after a reconnect): the server answers it once more if it
  //! has, and executes it only if it never received it.
  bool resend = false;
  //! The sender process's incarnation (as in its hello); 0: a sender that
  //! does not number its requests (each is executed as it comes).
  std::uint64_t process = 0;
};
//! Where a request header keeps `RequestHead::floor`, `incarnation` and the
//! flags (bit 0: resend), so a sender can mark a stored header as a resend.
inline constexpr std::size_t request_floor_at = 48;
inline constexpr std::size_t request_incarnation_at = 56;
inline constexpr std::size_t request_flags_at = 64;
inline constexpr std::uint32_t request_flag_resend = 1;
inline constexpr std::size_t request_process_at = 72;

//! Per item of a request: what its reply tensor is.
struct OutSpec {
  OutKind kind = OutKind::none;
  std::uint64_t count = 0;  //!< elements (floats or 16-bit words)
  std::uint64_t bytes() const noexcept { return count * (kind == OutKind::float32 ? 4u : 2u); }
};

//! Encodes `r` (worker side): the header frame, then the data frames as
//! segments borrowing `r`'s spans (ids, positions are never sent: a sender
//! groups rows per server before it encodes).
inline std::vector<std::byte> encode_request(const Request& r, const RequestHead& head,
                                             std::vector<Segment>& data) {
  // A reason longer than any receiver takes is cut, not refused with it.
  const std::string_view reason = std::string_view(r.reason).substr(0, Limits{}.max_text_bytes);
  auto out = make_header(request_fixed_bytes + item_bytes * r.items.size() + reason.size(), Kind::request,
                         static_cast<std::uint8_t>(r.op));
  put(out, 8, head.call);
  put(out, 16, head.fingerprint);
  put(out, 24, r.clock);
  put(out, 32, r.worker);
  put(out, 36, static_cast<std::uint32_t>(r.items.size()));
  put(out, 40, static_cast<std::uint32_t>(reason.size()));
  put(out, 44, head.chunk);
  put(out, request_floor_at, head.floor);
  put(out, request_incarnation_at, head.incarnation);
  put(out, request_flags_at, head.resend ? request_flag_resend : std::uint32_t{0});
  put(out, request_flags_at + 4, std::uint32_t{0});
  put(out, request_process_at, head.process);
  std::size_t at = request_fixed_bytes;
  for (const Item& item : r.items) {
    const bool low = !item.out16.empty();
    put(out, at, item.variable);
    put(out, at + 4, item.shard);
    put(out, at + 8, static_cast<std::uint64_t>(item.ids.size()));
    put(out, at + 16, static_cast<std::uint64_t>(item.in.size()));
    put(out, at + 24, static_cast<std::uint64_t>(low ? item.out16.size() : item.out.size()));
    put(out, at + 32, static_cast<std::uint64_t>(low ? OutKind::bits16 : item.out.empty() ? OutKind::none
                                                                                           : OutKind::float32));
    at += item_bytes;
  }
  if (!reason.empty()) std::memcpy(out.data() + at, reason.data(), reason.size());
  for (const Item& item : r.items) {
    add_tensor(data, item.ids.data(), item.ids.size_bytes(), head.chunk);
    add_tensor(data, item.in.data(), item.in.size_bytes(), head.chunk);
  }
  return out;
}

//! A decoded request (server side). The Request's spans point into the
//! received frames where a tensor came in one aligned frame, and into
//! `owned` where it had to be joined from chunks or realigned.
struct Incoming {
  Request request;
  RequestHead head;
  std::vector<OutSpec> outs;
  std::vector<std::unique_ptr<std::uint64_t[]>> owned;
};

//! Told by `decode_request` of the bytes `[from, to)` of data frame
//! `frame` as soon as it has copied them out (a tensor joined from chunks
//! into `Incoming::owned`, in steps of `release_step`), and never reads
//! them again: the receiver may let go of their memory there and then
//! (`to == size`: the whole frame is done), so that joining a tensor never
//! holds its frames and its joined copy whole at once (a 4 GiB push: its
//! frames and a step, not twice 4 GiB).
using ReleaseFrame = std::function<void(std::size_t frame, std::size_t from, std::size_t to)>;
//! How much of a frame is copied between two calls of a ReleaseFrame.
inline constexpr std::size_t release_step = std::size_t{64} << 20;

//! Copies frame `k`'s bytes `src` to `dst`, telling `release` (where
//! given) of each step copied.
inline void copy_frame(std::byte* dst, std::span<const std::byte> src, std::size_t k, const ReleaseFrame& release) {
  if (!release) {
    std::memcpy(dst, src.data(), src.size());
    return;
  }
  for (std::size_t at = 0; at < src.size();) {
    const std::size_t n = std::min(release_step, src.size() - at);
    std::memcpy(dst + at, src.data() + at, n);
    release(k, at, at + n);
    at += n;
  }
}

// Item `item`'s tensor of `count` elements starting at frame `next`: a span
// over the frame when it is one frame aligned for T, else a joined, aligned
// copy. Only this tensor's frames are looked at, and a message is built only
// for a refusal, so decoding stays linear in the items (a request may carry
// 2^20 of them).
template <class T>
std::span<const T> take_tensor(std::span<const std::span<const std::byte>> frames, std::size_t& next,
                               std::uint64_t count, std::uint32_t chunk, Incoming& in, std::string_view where,
                               std::uint32_t item, const ReleaseFrame& release = {}) {
  if (count == 0) return {};
  auto at = [&] { return std::string(where) + ", item " + std::to_string(item); };
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, sizeof(T), &bytes)) (void)checked_mul(count, sizeof(T), at());
  const std::uint64_t n = chunks(bytes, chunk);
  const std::size_t have = frames.size() - next;
  auto want = [&](std::uint64_t k) { return std::min<std::uint64_t>(chunk, bytes - k * chunk); };
  bool fits = n <= have;
  for (std::uint64_t k = 0; fits && k < n; ++k) fits = frames[next + k].size() == want(k);
  if (!fits) {
    // The bytes must be there before any size derived from them is trusted.
    std::uint64_t left = 0;
    for (std::size_t k = next; k < frames.size(); ++k) left += frames[k].size();
    if (bytes > left)
      throw wire_error("psx: " + at() + ": a " + std::to_string(bytes) + "-byte tensor, but only " +
                       std::to_string(left) + " bytes follow");
    if (n > have)
      throw wire_error("psx: " + at() + ": a " + std::to_string(bytes) + "-byte tensor needs " + std::to_string(n) +
                       " frames, only " + std::to_string(have) + " left");
    for (std::uint64_t k = 0; k < n; ++k)
      if (frames[next + k].size() != want(k))
        throw wire_error("psx: " + at() + ": frame " + std::to_string(next + k) + " has " +
                         std::to_string(frames[next + k].size()) + " bytes, expected " + std::to_string(want(k)));
  }
  const std::byte* first = frames[next].data();
  if (n == 1 && reinterpret_cast<std::uintptr_t>(first) % alignof(T) == 0) {
    next += 1;
    return {reinterpret_cast<const T*>(first), static_cast<std::size_t>(count)};
  }
  auto& buf = in.owned.emplace_back(new std::uint64_t[(bytes + 7) / 8]);
  auto* dst = reinterpret_cast<std::byte*>(buf.get());
  for (std::uint64_t k = 0; k < n; ++k) {
    copy_frame(dst, frames[next], next, release);
    dst += frames[next].size();
    ++next;
  }
  return {reinterpret_cast<const T*>(buf.get()), static_cast<std::size_t>(count)};
}

//! Decodes a request of this version: `frames[0]` is the header. Checks
//! every count against the frames and `limits` before using it; the item
//! contents (variable, shard, sizes against the shard) are the server's to
//! check. `where` names the sender in messages; `release`, where given,
//! is told of each frame copied out (ReleaseFrame).
inline Incoming decode_request(std::span<const std::span<const std::byte>> frames, const Limits& limits,
                               std::string_view where, const ReleaseFrame& release = {}) {
  if (frames.empty()) throw wire_error("psx: " + std::string(where) + ": an empty message");
  const auto h = frames[0];
  const Prefix p = read_prefix(h, where);
  if (p.kind != Kind::request)
    throw wire_error("psx: " + std::string(where) + ": expected a request, got message kind " +
                     std::to_string(static_cast<int>(p.kind)));
  if (p.version != version)
    throw wire_error("psx: " + std::string(where) + " speaks " + version_text(p.version) + ", this server " +
                     version_text(version));
  if (h.size() < request_fixed_bytes)
    throw wire_error("psx: " + std::string(where) + ": a " + std::to_string(h.size()) +
                     "-byte request header is shorter than its fixed " + std::to_string(request_fixed_bytes) + " bytes");
  std::uint64_t total = 0;
  for (const auto& f : frames) total += f.size();
  if (total > limits.max_message_bytes)
    throw wire_error("psx: " + std::string(where) + ": a " + std::to_string(total) +
                     "-byte message is over the limit of " + std::to_string(limits.max_message_bytes) + " bytes");
  Incoming in;
  Request& r = in.request;
  if (p.byte7 > static_cast<std::uint8_t>(Op::table_export))
    throw wire_error("psx: " + std::string(where) + ": unknown operation " + std::to_string(p.byte7));
  r.op = static_cast<Op>(p.byte7);
  in.head.call = get<std::uint64_t>(h, 8);
  in.head.fingerprint = get<std::uint64_t>(h, 16);
  r.clock = get<std::uint64_t>(h, 24);
  r.worker = get<std::uint32_t>(h, 32);
  const auto items = get<std::uint32_t>(h, 36);
  const auto reason = get<std::uint32_t>(h, 40);
  in.head.chunk = get<std::uint32_t>(h, 44);
  in.head.floor = get<std::uint64_t>(h, request_floor_at);
  in.head.incarnation = get<std::uint64_t>(h, request_incarnation_at);
  const auto flags = get<std::uint32_t>(h, request_flags_at);
  if ((flags & ~request_flag_resend) != 0 || get<std::uint32_t>(h, request_flags_at + 4) != 0)
    throw wire_error("psx: " + std::string(where) + ": unknown request flags " + std::to_string(flags) +
                     " (or a reserved word set)");
  in.head.resend = (flags & request_flag_resend) != 0;
  in.head.process = get<std::uint64_t>(h, request_process_at);
  if (items > limits.max_items)
    throw wire_error("psx: " + std::string(where) + ": " + std::to_string(items) + " items, over the limit of " +
                     std::to_string(limits.max_items));
  if (reason > limits.max_text_bytes)
    throw wire_error("psx: " + std::string(where) + ": a " + std::to_string(reason) +
                     "-byte reason, over the limit of " + std::to_string(limits.max_text_bytes));
  if (in.head.chunk == 0 || in.head.chunk > max_chunk_bytes)
    throw wire_error("psx: " + std::string(where) + ": chunk size " + std::to_string(in.head.chunk) +
                     " outside [1, 2^31 - 1]");
  const std::uint64_t want = request_fixed_bytes + std::uint64_t{item_bytes} * items + reason;
  if (h.size() != want)
    throw wire_error("psx: " + std::string(where) + ": the header has " + std::to_string(h.size()) +
                     " bytes; " + std::to_string(items) + " items and a " + std::to_string(reason) +
                     "-byte reason make " + std::to_string(want));
  r.reason.assign(reinterpret_cast<const char*>(h.data()) + request_fixed_bytes + item_bytes * items, reason);
  r.items.resize(items);
  in.outs.resize(items);
  std::size_t next = 1;
  std::uint64_t reply_bytes = 0;  // what the server would allocate for the answers
  for (std::uint32_t i = 0; i < items; ++i) {
    const std::size_t at = request_fixed_bytes + std::size_t{item_bytes} * i;
    Item& item = r.items[i];
    item.variable = get<std::uint32_t>(h, at);
    item.shard = get<std::uint32_t>(h, at + 4);
    const auto ids = get<std::uint64_t>(h, at + 8);
    const auto ins = get<std::uint64_t>(h, at + 16);
    OutSpec& o = in.outs[i];
    o.count = get<std::uint64_t>(h, at + 24);
    const auto kind = get<std::uint64_t>(h, at + 32);
    if (kind > static_cast<std::uint64_t>(OutKind::bits16) || (kind == 0) != (o.count == 0))
      throw wire_error("psx: " + std::string(where) + ": item " + std::to_string(i) + " has output kind " +
                       std::to_string(kind) + " for " + std::to_string(o.count) + " elements");
    o.kind = static_cast<OutKind>(kind);
    // A reply the server would have to allocate counts against the limit too.
    if (o.count > limits.max_message_bytes / 4)
      throw wire_error("psx: " + std::string(where) + ": item " + std::to_string(i) + " asks for " +
                       std::to_string(o.count) + " elements back, over the message limit");
    // And the whole reply: many items each within the limit (one shard named
    // a million times) would make the server allocate without bound.
    if (o.bytes() > limits.max_message_bytes - reply_bytes)
      throw wire_error("psx: " + std::string(where) + ": items 0 to " + std::to_string(i) + " ask for " +
                       std::to_string(reply_bytes + o.bytes()) + " bytes back, over the message limit of " +
                       std::to_string(limits.max_message_bytes));
    reply_bytes += o.bytes();
    item.ids = take_tensor<std::uint64_t>(frames, next, ids, in.head.chunk, in, where, i, release);
    item.in = take_tensor<float>(frames, next, ins, in.head.chunk, in, where, i, release);
  }
  if (next != frames.size())
    throw wire_error("psx: " + std::string(where) + ": " + std::to_string(frames.size() - next) +
                     " frames beyond what the header describes");
  return in;
}

// -- replies -----------------------------------------------------------------

//! The status of the exception `e` and its message.
inline std::pair<Status, std::string> status_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const unknown_variable& x) {
    return {Status::unknown_variable, x.what()};
  } catch (const duplicate_variable& x) {
    return {Status::duplicate_variable, x.what()};
  } catch (const shape_error& x) {
    return {Status::shape_error, x.what()};
  } catch (const row_out_of_range& x) {
    return {Status::row_out_of_range, x.what()};
  } catch (const frozen_variable& x) {
    return {Status::frozen_variable, x.what()};
  } catch (const shutdown_error& x) {
    return {Status::shutdown_error, x.what()};
  } catch (const config_error& x) {
    return {Status::config_error, x.what()};
  } catch (const sync_error& x) {
    return {Status::sync_error, x.what()};
  } catch (const wire_error& x) {
    return {Status::wire_error, x.what()};
  } catch (const checkpoint_error& x) {
    return {Status::checkpoint_error, x.what()};
  } catch (const peer_lost& x) {
    return {Status::peer_lost, x.what()};
  } catch (const std::exception& x) {
    return {Status::error, x.what()};
  } catch (...) {
    return {Status::error, "psx: a non-standard exception"};
  }
}

//! The exception a reply's status and text stand for.
inline std::exception_ptr exception_of(Status s, const std::string& what) {
  switch (s) {
    case Status::unknown_variable: return std::make_exception_ptr(unknown_variable(what));
    case Status::duplicate_variable: return std::make_exception_ptr(duplicate_variable(what));
    case Status::shape_error: return std::make_exception_ptr(shape_error(what));
    case Status::row_out_of_range: return std::make_exception_ptr(row_out_of_range(what));
    case Status::frozen_variable: return std::make_exception_ptr(frozen_variable(what));
    case Status::shutdown_error: return std::make_exception_ptr(shutdown_error(what));
    case Status::config_error: return std::make_exception_ptr(config_error(what));
    case Status::sync_error: return std::make_exception_ptr(sync_error(what));
    case Status::wire_error: return std::make_exception_ptr(wire_error(what));
    case Status::checkpoint_error: return std::make_exception_ptr(checkpoint_error(what));
    case Status::peer_lost: return std::make_exception_ptr(peer_lost(what));
    default: return std::make_exception_ptr(error(what));
  }
}

//! Encodes a reply header: status, error text, number of tensors that follow.
inline std::vector<std::byte> encode_reply(std::uint64_t call, Status status, std::string_view text,
                                           std::uint32_t tensors, std::uint32_t chunk) {
  const std::size_t n = std::min<std::size_t>(text.size(), 1u << 16);
  auto out = make_header(reply_fixed_bytes + n, Kind::reply, static_cast<std::uint8_t>(status));
  put(out, 8, call);
  put(out, 16, tensors);
  put(out, 20, chunk);
  put(out, 24, static_cast<std::uint32_t>(n));
  put(out, 28, std::uint32_t{0});
  if (n != 0) std::memcpy(out.data() + reply_fixed_bytes, text.data(), n);
  return out;
}

//! A decoded reply header (worker side); the tensors follow in frames 1...
struct ReplyHead {
  std::uint64_t call = 0;
  Status status = Status::ok;
  std::string text;
  std::uint32_t tensors = 0;
  std::uint32_t chunk = max_chunk_bytes;
};

inline ReplyHead decode_reply_head(std::span<const std::byte> h, std::string_view where) {
  const Prefix p = read_prefix(h, where);
  if (p.kind != Kind::reply)
    throw wire_error("psx: " + std::string(where) + ": expected a reply, got message kind " +
                     std::to_string(static_cast<int>(p.kind)));
  if (p.version != version)
    throw wire_error("psx: " + std::string(where) + " speaks " + version_text(p.version) + ", this worker " +
                     version_text(version));
  if (h.size() < reply_fixed_bytes || get<std::uint32_t>(h, 24) != h.size() - reply_fixed_bytes)
    throw wire_error("psx: " + std::string(where) + ": a malformed reply header (" + std::to_string(h.size()) +
                     " bytes)");
  if (p.byte7 > static_cast<std::uint8_t>(Status::peer_lost))
    throw wire_error("psx: " + std::string(where) + ": unknown reply status " + std::to_string(p.byte7));
  ReplyHead r;
  r.status = static_cast<Status>(p.byte7);
  r.call = get<std::uint64_t>(h, 8);
  r.tensors = get<std::uint32_t>(h, 16);
  r.chunk = get<std::uint32_t>(h, 20);
  if (r.chunk == 0 || r.chunk > max_chunk_bytes)
    throw wire_error("psx: " + std::string(where) + ": chunk size " + std::to_string(r.chunk) +
                     " outside [1, 2^31 - 1]");
  r.text.assign(reinterpret_cast<const char*>(h.data()) + reply_fixed_bytes, h.size() - reply_fixed_bytes);
  return r;
}

//! Checks that `frames` (header first) carry exactly the tensors `outs`
//! announces, chunked by `chunk`; throws wire_error otherwise.
inline void check_reply_tensors(std::span<const std::span<const std::byte>> frames, std::span<const OutSpec> outs,
                                std::uint32_t chunk, std::string_view where) {
  std::size_t next = 1;
  std::uint64_t left = 0;
  for (std::size_t k = 1; k < frames.size(); ++k) left += frames[k].size();
  for (const OutSpec& o : outs) {
    const std::uint64_t bytes = o.bytes();
    if (bytes > left)
      throw wire_error("psx: " + std::string(where) + ": the reply is missing " + std::to_string(bytes - left) +
                       " bytes");
    left -= bytes;
    const std::uint64_t n = chunks(bytes, chunk);
    if (n > frames.size() - next)
      throw wire_error("psx: " + std::string(where) + ": the reply is missing frames (" +
                       std::to_string(frames.size()) + " received)");
    for (std::uint64_t k = 0; k < n; ++k, ++next) {
      const std::uint64_t want = std::min<std::uint64_t>(chunk, bytes - k * chunk);
      if (frames[next].size() != want)
        throw wire_error("psx: " + std::string(where) + ": reply frame " + std::to_string(next) + " has " +
                         std::to_string(frames[next].size()) + " bytes, expected " + std::to_string(want));
    }
  }
  if (next != frames.size())
    throw wire_error("psx: " + std::string(where) + ": " + std::to_string(frames.size() - next) +
                     " reply frames beyond the expected tensors");
}

// -- the cluster's fingerprint ----------------------------------------------

//! FNV-1a over everything both sides must agree on: the cluster's size and
//! every variable's name, shape, kind, dtype and placement. A worker and a
//! server built from different declarations disagree on it.
inline std::uint64_t fingerprint(std::size_t num_servers, std::size_t num_workers,
                                 std::span<const VariableInfo> variables) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  auto mix = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 1099511628211ull;
    }
  };
  auto word = [&](std::uint64_t v) { mix(&v, sizeof v); };
  word(num_servers);
  word(num_workers);
  word(variables.size());
  for (const VariableInfo& v : variables) {
    word(v.meta.name.size());
    mix(v.meta.name.data(), v.meta.name.size());
    word(v.meta.shape.size());
    for (std::size_t e : v.meta.shape) word(e);
    word(static_cast<std::uint64_t>(v.meta.kind));
    word(static_cast<std::uint64_t>(v.meta.dtype));
    word(v.trainable);
    if (v.meta.kind == VariableKind::dynamic) {
      // Every process must place ids on the same ring and treat them alike.
      const TableOptions& t = v.table;
      const Admission& a = t.admission;
      std::uint64_t p;
      std::memcpy(&p, &a.probability, sizeof p);
      for (const std::uint64_t x : {std::uint64_t(a.kind), std::uint64_t{a.pushes}, p, a.seed, std::uint64_t{a.sketch_width},
                                    std::uint64_t{a.sketch_depth}, a.sketch_window, t.ttl_steps, t.ttl_sweep_steps,
                                    t.memory_cap_bytes, std::uint64_t{t.virtual_nodes}, std::uint64_t{t.stripes},
                                    t.removal_log_limit})
        word(x);
    }
    word(v.shards.size());
    for (const Shard& s : v.shards) {
      word(s.server);
      word(s.row_begin);
      word(s.row_end);
    }
  }
  return h;
}

}  // namespace detail::wire
}  // namespace v0
}  // namespace psx
