// TensorBoard summaries: records byte for byte as protobuf and TFRecord write
// them, TensorFlow's histogram buckets, the reader's checks (every flipped
// bit and every truncation named with its offset), buffering and threads.
#include <psx/summary.hpp>

#include "../support.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;
using psx::summary::Value;
using psx_test::TempDir;

namespace {

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::string& s) {
  // A new file, not a truncated one: ext4 writes a file truncated and
  // rewritten back at close (auto_da_alloc), 3 ms a time.
  fs::remove(p);
  std::ofstream(p, std::ios::binary).write(s.data(), static_cast<std::streamsize>(s.size()));
}

std::string from_hex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

std::string record(std::string_view data) {
  std::string out;
  psx::detail::append_record(out, data);
  return out;
}

// The byte offsets at which the file's records start.
std::vector<std::size_t> record_offsets(const std::string& file) {
  std::vector<std::size_t> offsets;
  for (std::size_t pos = 0; pos + 8 <= file.size();) {
    offsets.push_back(pos);
    std::uint64_t len = 0;
    std::memcpy(&len, file.data() + pos, 8);
    pos += 16 + static_cast<std::size_t>(len);
  }
  return offsets;
}

std::string read_error(const fs::path& p) {
  return psx_test::message_of<psx::summary_error>([&] { psx::summary::read_events(p); });
}

}  // namespace

TEST_CASE("summary: TensorFlow's default bucket limits") {
  const auto& limits = psx::summary::default_bucket_limits();
  REQUIRE(limits.size() == 1551);
  CHECK(limits.front() == -DBL_MAX);
  CHECK(limits.back() == DBL_MAX);
  CHECK(limits[775] == 0.0);
  CHECK(limits[776] == 1e-12);
  CHECK(limits[777] == 1e-12 * 1.1);
  CHECK(limits[1549] == 9.920775621859783e+19);  // the last below 1e20 (Python's repeated * 1.1)
  for (std::size_t i = 0; i + 1 < limits.size(); ++i) {
    REQUIRE(limits[i] < limits[i + 1]);
    REQUIRE(limits[i] == -limits[limits.size() - 1 - i]);
  }
}

TEST_CASE("summary: histograms bucket as TensorFlow's Histogram::EncodeToProto(proto, false)") {
  SUBCASE("one value: the zero run below, its bucket, the zero run above") {
    const float v[] = {0.5f};
    const auto h = psx::summary::make_histogram(v);
    // Computed by an independent Python implementation of histogram.cc.
    CHECK(h.bucket_limit == std::vector<double>{0.47069243095356195, 0.51776167404891815, DBL_MAX});
    CHECK(h.bucket == std::vector<double>{0, 1, 0});
    CHECK(h.min == 0.5);
    CHECK(h.max == 0.5);
    CHECK(h.num == 1);
    CHECK(h.sum == 0.5);
    CHECK(h.sum_squares == 0.25);
  }
  SUBCASE("counts, edges, non-finite values left out") {
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> v = {-1.0f, 0.0f, 0.0f, 0.5f, 2.0f, 2.0f, 1e25f, -3e38f, std::nanf(""), inf, -inf};
    const auto h = psx::summary::make_histogram(v);
    CHECK(h.num == 8);
    CHECK(h.min == static_cast<double>(-3e38f));
    CHECK(h.max == static_cast<double>(1e25f));
    CHECK(h.sum == -1.0 + 0.5 + 4.0 + static_cast<double>(1e25f) + static_cast<double>(-3e38f));
    REQUIRE(h.bucket.size() == h.bucket_limit.size());
    double total = 0;
    std::map<double, double> count_at;  // by bucket limit
    for (std::size_t i = 0; i < h.bucket.size(); ++i) {
      total += h.bucket[i];
      count_at[h.bucket_limit[i]] = h.bucket[i];
      if (i > 0) CHECK_FALSE((h.bucket[i] == 0 && h.bucket[i - 1] == 0));  // empty runs collapsed
      if (i > 0) CHECK(h.bucket_limit[i - 1] < h.bucket_limit[i]);
    }
    CHECK(total == 8);
    CHECK(count_at[1e-12] == 2);     // 0 lies in [0, 1e-12)
    CHECK(count_at[DBL_MAX] == 1);   // 1e25 beyond the last finite limit
    // 6 non-empty buckets, each after a run of empty ones (-3e38's after the
    // one below -DBL_MAX); none after 1e25's, the last.
    CHECK(h.bucket.size() == 2 * 6);
    // Each non-empty bucket [previous limit, limit) holds its values.
    const auto& limits = psx::summary::default_bucket_limits();
    for (const float x : {-1.0f, 2.0f, 0.5f}) {
      const auto it = std::upper_bound(limits.begin(), limits.end(), static_cast<double>(x));
      CHECK(*(it - 1) <= x);
      CHECK(count_at[*it] == (x == 2.0f ? 2 : 1));
    }
  }
  SUBCASE("no values: one empty bucket, min and max as TensorFlow leaves them") {
    const auto h = psx::summary::make_histogram({});
    CHECK(h.bucket_limit == std::vector<double>{DBL_MAX});
    CHECK(h.bucket == std::vector<double>{0});
    CHECK(h.min == DBL_MAX);
    CHECK(h.max == -DBL_MAX);
    CHECK(h.num == 0);
  }
}

TEST_CASE("summary: records are the bytes protobuf and TFRecord would write") {
  // Generated independently: tensorboard's protobuf classes serialized the
  // Events (text_pb made the text one) and a bitwise CRC-32C framed them.
  using namespace psx::detail;
  CHECK(record(summary_event(1.5, 0, {}, "brain.Event:2")) ==
        from_hex("1800000000000000a37f4b2209000000000000f83f1a0d627261696e2e4576656e743a322a28646c"));
  CHECK(record(summary_event(1.5, 3, scalar_value("loss", 0.25f))) ==
        from_hex("1a00000000000000129bd82d09000000000000f83f10032a0d0a0b0a046c6f7373150000803ed054b255"));
  CHECK(record(summary_event(1.5, 7, text_value("notes", "hello"))) ==
        from_hex("2d000000000000003c418afb09000000000000f83f10072a200a1e0a056e6f746573420b08071200420568656c6c6f4a08"
                 "0a060a0474657874d6a0f912"));
  const float half[] = {0.5f};
  CHECK(record(summary_event(1.5, -2, histogram_value("w", psx::summary::make_histogram(half)))) ==
        from_hex("7e00000000000000d8c65c7509000000000000f83f10feffffffffffffffff012a680a660a01772a6109000000000000e03f"
                 "11000000000000e03f19000000000000f03f21000000000000e03f29000000000000d03f3218fae55a25d31fde3fb03125"
                 "ee8091e03fffffffffffffef7f3a180000000000000000000000000000f03f0000000000000000ab888078"));
  // The CRC itself, on the standard check input.
  const std::string check = "123456789";
  CHECK(crc32c(std::as_bytes(std::span(check.data(), check.size()))) == 0xE3069283u);

  SUBCASE("a new file starts with the file_version record") {
    TempDir dir("psx-summary");
    psx::SummaryWriter w(dir.path);
    const std::string file = bytes_of(w.path());
    REQUIRE(file.size() == 40);
    double wall_time = 0;
    std::memcpy(&wall_time, file.data() + 13, 8);
    CHECK(file == record(summary_event(wall_time, 0, {}, "brain.Event:2")));
    CHECK(file.substr(0, 13) == from_hex("1800000000000000") + file.substr(8, 4) + "\x09");
    CHECK(file.substr(21, 15) == std::string("\x1a\x0d") + "brain.Event:2");
  }
}

TEST_CASE("summary: write, then read back every value") {
  TempDir dir("psx-summary");
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  fs::path file;
  {
    psx::SummaryWriter w(dir.path / "run" / "one");  // created
    file = w.path();
    w.scalar("loss", 0.75f, 0);
    w.scalar("loss", -0.0f, 1);
    w.scalar("loss", std::numeric_limits<float>::quiet_NaN(), 2);
    w.scalar("loss", std::numeric_limits<float>::infinity(), -5);
    w.scalar("loss", 3.0f, std::numeric_limits<std::int64_t>::max());
    const std::vector<float> weights = {1, 2, 2, 3, -4};
    w.histogram("weights", weights, 7);
    w.text("notes", "**bold** and ünïcödé", 8);
    w.text("empty", "", 9);
  }  // closed by the destructor
  const double after = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();

  const std::string name = file.filename().string();
  CHECK(file.parent_path() == dir.path / "run" / "one");
  REQUIRE(name.rfind("events.out.tfevents.", 0) == 0);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string rest = name.substr(20);  // <10 digits>.<host>.<pid>.<n>
  CHECK(rest.size() > 11);
  CHECK(rest.find_first_not_of("0123456789") == 10);
  CHECK(std::stoll(rest.substr(0, 10)) >= static_cast<long long>(before));
  CHECK(rest.substr(10, std::strlen(host) + 2) == "." + std::string(host) + ".");
  CHECK(rest.find("." + std::to_string(::getpid()) + ".") != std::string::npos);

  const auto events = psx::summary::read_events(file);
  REQUIRE(events.size() == 9);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[0].values.empty());
  for (const auto& e : events) {
    CHECK(e.wall_time >= before - 1);
    CHECK(e.wall_time <= after + 1);
  }
  const std::int64_t steps[] = {0, 0, 1, 2, -5, std::numeric_limits<std::int64_t>::max(), 7, 8, 9};
  for (std::size_t i = 0; i < events.size(); ++i) CHECK(events[i].step == steps[i]);
  for (std::size_t i = 1; i <= 5; ++i) {
    REQUIRE(events[i].values.size() == 1);
    CHECK(events[i].values[0].tag == "loss");
    CHECK(events[i].values[0].kind == Value::Kind::scalar);
  }
  CHECK(events[1].values[0].scalar == 0.75f);
  CHECK(std::signbit(events[2].values[0].scalar));
  CHECK(std::isnan(events[3].values[0].scalar));
  CHECK(events[4].values[0].scalar == std::numeric_limits<float>::infinity());
  CHECK(events[5].values[0].scalar == 3.0f);

  const Value& h = events[6].values.at(0);
  CHECK(h.tag == "weights");
  REQUIRE(h.kind == Value::Kind::histogram);
  const std::vector<float> weights = {1, 2, 2, 3, -4};
  CHECK(h.histogram == psx::summary::make_histogram(weights));
  CHECK(h.histogram.num == 5);
  CHECK(h.histogram.sum == 4);
  CHECK(h.histogram.sum_squares == 34);
  CHECK(h.histogram.min == -4);
  CHECK(h.histogram.max == 3);
  double counted = 0;
  for (double c : h.histogram.bucket) counted += c;
  CHECK(counted == 5);
  CHECK(std::count(h.histogram.bucket.begin(), h.histogram.bucket.end(), 2.0) == 1);

  const Value& t = events[7].values.at(0);
  CHECK(t.kind == Value::Kind::text);
  CHECK(t.tag == "notes");
  CHECK(t.text == "**bold** and ünïcödé");
  CHECK(t.plugin_name == "text");
  CHECK(events[8].values.at(0).kind == Value::Kind::text);
  CHECK(events[8].values.at(0).text.empty());
}

TEST_CASE("summary: a tag that is not UTF-8, or a hand-made histogram TensorBoard cannot draw, is refused") {
  TempDir dir("psx-summary");
  psx::SummaryWriter w(dir.path);
  // Accepted: UTF-8 of 1 to 4 bytes a character, and the empty tag.
  w.scalar("λ/loss", 1, 1);
  w.scalar("\xF0\x9D\x9B\xBC\xEF\xBF\xBF\xF4\x8F\xBF\xBF", 2, 2);  // U+1D6FC, U+FFFF, U+10FFFF
  w.scalar("", 3, 3);
  w.flush();
  const auto size = fs::file_size(w.path());
  // Refused, each with the byte where it goes wrong.
  const std::pair<std::string, std::string> bad_tags[] = {
      {"loss\xFF", "byte 4"},                 // not a lead byte
      {"a\xC0\xAF", "byte 1"},               // '/' in two bytes (overlong)
      {"\xE0\x80\xAF", "byte 0"},           // '/' in three bytes (overlong)
      {"x\xED\xA0\x80", "byte 1"},          // a surrogate, U+D800
      {"\xF4\x90\x80\x80", "byte 0"},      // U+110000
      {"ok\xE2\x82", "byte 2"},              // cut short at the end
      {"\xE2\x28\xA1", "byte 0"},           // a continuation byte missing
      {"\x80", "byte 0"},                     // a continuation byte alone
  };
  for (const auto& [tag, where] : bad_tags) {
    CAPTURE(where);
    const auto e = psx_test::message_of<psx::summary_error>([&] { w.scalar(tag, 1, 4); });
    CHECK(e.find("is not UTF-8 (" + where + ")") != std::string::npos);
    CHECK(e.find("\\x") != std::string::npos);  // the bad bytes escaped in the message
    CHECK_THROWS_AS(w.text(tag, "t", 4), psx::summary_error);
    CHECK_THROWS_AS(w.histogram(tag, std::vector<float>{1.0f}, 4), psx::summary_error);
  }
  // A hand-made histogram: as many counts as limits, limits ascending, counts finite and >= 0.
  psx::summary::Histogram h;
  h.min = 0, h.max = 2, h.num = 3, h.sum = 3, h.sum_squares = 5;
  h.bucket_limit = {0.5, 1.5, DBL_MAX};
  h.bucket = {1, 1, 1};
  auto refused = [&](const psx::summary::Histogram& bad) {
    return psx_test::message_of<psx::summary_error>([&] { w.histogram("h", bad, 5); });
  };
  auto mismatched = h;
  mismatched.bucket.pop_back();
  CHECK(refused(mismatched).find("histogram \"h\": 3 bucket limits but 2 buckets") != std::string::npos);
  auto descending = h;
  descending.bucket_limit[1] = 0.5;
  CHECK(refused(descending).find("not ascending at 1") != std::string::npos);
  auto negative = h;
  negative.bucket[2] = -1;
  CHECK(refused(negative).find("bucket 2 counts") != std::string::npos);
  auto nan = h;
  nan.bucket[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK(refused(nan).find("bucket 0 counts") != std::string::npos);
  auto inf = h;
  inf.bucket[1] = std::numeric_limits<double>::infinity();
  CHECK(refused(inf).find("bucket 1 counts") != std::string::npos);
  // min and max draw the outer buckets' edges: finite, in order, once it counts anything.
  auto backwards = h;
  backwards.min = 3;
  CHECK(refused(backwards).find("histogram \"h\": min 3.000000 and max 2.000000 of 3.000000 values") !=
        std::string::npos);
  auto unbounded = h;
  unbounded.max = std::numeric_limits<double>::quiet_NaN();
  CHECK(refused(unbounded).find("and max nan") != std::string::npos);
  // Text is UTF-8 too: TensorBoard's text plugin decodes it so.
  CHECK(psx_test::message_of<psx::summary_error>([&] { w.text("notes", "caf\xE9", 5); }) ==
        "psx::summary: the text of \"notes\" is not UTF-8 (byte 3); nothing written");
  w.flush();
  CHECK(fs::file_size(w.path()) == size);  // nothing refused was written
  w.histogram("h", h, 6);                  // and the writer goes on
  w.close();
  const auto events = psx::summary::read_events(w.path());
  REQUIRE(events.size() == 5);
  CHECK(events[1].values.at(0).tag == "λ/loss");
  CHECK(events[3].values.at(0).tag.empty());
  CHECK(events[4].values.at(0).histogram == h);
}

TEST_CASE("summary: a writer makes a file of its own, never appending to another's of the same name") {
  // Two writers with the same host name and pid (containers with a fixed
  // host name, each process pid 1) starting in the same second: the second
  // appended its records to the first one's file.
  TempDir dir("psx-summary");
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const std::uint64_t next = psx::detail::next_event_file_number() + 1;
  std::vector<fs::path> others;
  for (long long second = now; second <= now + 1; ++second)  // the writer's second may be the next one
    for (std::uint64_t n = next; n < next + 3; ++n) {
      char stamp[32];
      std::snprintf(stamp, sizeof stamp, "%010lld", second);
      others.push_back(dir.path / ("events.out.tfevents." + std::string(stamp) + "." + host + "." +
                                   std::to_string(::getpid()) + "." + std::to_string(n)));
      std::ofstream(others.back()) << "other";
    }
  psx::SummaryWriter w(dir.path);
  w.scalar("loss", 1, 1);
  w.close();
  for (const fs::path& p : others) {
    CHECK(p != w.path());
    CHECK(fs::file_size(p) == 5);  // as it was
  }
  const auto events = psx::summary::read_events(w.path());
  REQUIRE(events.size() == 2);
  CHECK(events[0].file_version == "brain.Event:2");
}

TEST_CASE("summary: reading back, the documented way") {
  TempDir dir("psx-summary");
  fs::path path;
  {
    psx::SummaryWriter summaries(dir.path);
    path = summaries.path();
    for (std::int64_t step = 0; step < 3; ++step) summaries.scalar("loss", 1.0f / static_cast<float>(step + 1), step);
  }
  // example-begin summary-read
  std::map<std::int64_t, float> loss;
  for (const psx::summary::Event& event : psx::summary::read_events(path))
    for (const psx::summary::Value& value : event.values)
      if (value.tag == "loss" && value.kind == psx::summary::Value::Kind::scalar) loss[event.step] = value.scalar;
  // example-end
  CHECK(loss == std::map<std::int64_t, float>{{0, 1.0f}, {1, 0.5f}, {2, 1.0f / 3.0f}});
}

TEST_CASE("summary: buffered until flush, close or the Options say") {
  TempDir dir("psx-summary");
  SUBCASE("default: only the header until flush()") {
    psx::SummaryWriter w(dir.path);
    w.scalar("a", 1, 1);
    w.text("b", std::string(1000, 'x'), 1);
    CHECK(fs::file_size(w.path()) == 40);
    w.flush();
    CHECK(psx::summary::read_events(w.path()).size() == 3);
    w.scalar("a", 2, 2);
    CHECK(psx::summary::read_events(w.path()).size() == 3);
    w.close();
    CHECK(psx::summary::read_events(w.path()).size() == 4);
    w.close();  // a second close does nothing
    const auto closed = psx_test::message_of<psx::summary_error>([&] { w.scalar("a", 3, 3); });
    CHECK(closed.find(w.path().string()) != std::string::npos);
    CHECK(closed.find("closed") != std::string::npos);
    CHECK_THROWS_AS(w.flush(), psx::summary_error);
  }
  SUBCASE("flush_bytes") {
    psx::SummaryWriter w(dir.path, {.flush_bytes = 200});
    w.scalar("a", 1, 1);
    CHECK(fs::file_size(w.path()) == 40);
    w.text("b", std::string(300, 'x'), 1);
    CHECK(psx::summary::read_events(w.path()).size() == 3);
  }
  SUBCASE("flush_every 0: every call") {
    psx::SummaryWriter w(dir.path, {.filename_suffix = ".v2", .flush_every = std::chrono::milliseconds(0)});
    CHECK(w.path().string().ends_with(".v2"));
    w.scalar("a", 1, 1);
    CHECK(psx::summary::read_events(w.path()).size() == 2);
  }
  SUBCASE("two writers in one directory: two files") {
    psx::SummaryWriter a(dir.path), b(dir.path);
    CHECK(a.path() != b.path());
    CHECK(a.path().parent_path() == b.path().parent_path());
  }
  SUBCASE("options are values") {
    psx::summary::Options o{.flush_bytes = 7};
    CHECK(o == psx::summary::Options{.flush_bytes = 7});
    CHECK_FALSE(o == psx::summary::Options{});
    std::ostringstream os;
    os << o;
    CHECK(os.str() == "summary::Options{filename_suffix=\"\", flush_bytes=7, flush_every=120000ms}");
  }
}

TEST_CASE("summary: several threads log at once") {
  psx_test::Watchdog watchdog("summary threads");
  TempDir dir("psx-summary");
  constexpr int kThreads = 4, kSteps = 300;
  fs::path path;
  {
    psx::SummaryWriter w(dir.path, {.flush_bytes = 4096});
    path = w.path();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&w, t] {
        const std::string tag = "thread" + std::to_string(t);
        const std::vector<float> values = {static_cast<float>(t), 1.5f};
        for (int s = 0; s < kSteps; ++s) {
          w.scalar(tag, static_cast<float>(s * kThreads + t), s);
          if (s % 50 == 0) w.histogram(tag + "/h", values, s);
          if (s % 97 == 0) w.flush();
        }
      });
    for (auto& th : threads) th.join();
  }
  std::map<std::string, std::vector<std::int64_t>> steps;
  std::size_t histograms = 0;
  for (const auto& e : psx::summary::read_events(path))
    for (const auto& v : e.values) {
      if (v.kind == Value::Kind::histogram) {
        ++histograms;
        CHECK(v.histogram.num == 2);
        continue;
      }
      REQUIRE(v.kind == Value::Kind::scalar);
      CHECK(v.scalar == static_cast<float>(e.step * kThreads + (v.tag.back() - '0')));
      steps[v.tag].push_back(e.step);
    }
  CHECK(histograms == kThreads * 6);
  REQUIRE(steps.size() == kThreads);
  for (const auto& [tag, s] : steps) {
    REQUIRE(s.size() == kSteps);
    for (int i = 0; i < kSteps; ++i) CHECK(s[i] == i);  // each thread's records in its order
  }
}

TEST_CASE("summary: every corrupted or truncated record is named with its offset") {
  TempDir dir("psx-summary");
  fs::path good;
  {
    psx::SummaryWriter w(dir.path / "good");
    good = w.path();
    w.scalar("loss", 1, 1);
    const std::vector<float> v = {1, 2, 3};
    w.histogram("h", v, 2);
    w.text("t", "text", 3);
  }
  const std::string file = bytes_of(good);
  const auto offsets = record_offsets(file);
  REQUIRE(offsets.size() == 4);
  const fs::path bad = dir.path / "bad";

  SUBCASE("a flipped bit anywhere") {
    for (std::size_t r = 0; r < offsets.size(); ++r) {
      const std::size_t end = r + 1 < offsets.size() ? offsets[r + 1] : file.size();
      for (std::size_t byte = offsets[r]; byte < end; ++byte) {
        std::string copy = file;
        copy[byte] = static_cast<char>(copy[byte] ^ (1 << (byte % 8)));
        write_bytes(bad, copy);
        const std::string e = read_error(bad);
        INFO("byte " << byte << ": " << e);
        CHECK(e.find(bad.string()) != std::string::npos);
        CHECK(e.find("record at byte offset " + std::to_string(offsets[r]) + ":") != std::string::npos);
        // A bit of the length may make the record look longer than the file
        // (its CRC is checked first, so this is the CRC message).
        CHECK(e.find(byte < offsets[r] + 12 ? "the length's CRC does not match" : "the data's CRC does not match") !=
              std::string::npos);
        // Corruption is no truncated tail: it throws whatever the tail option.
        CHECK_THROWS_AS(psx::summary::read_events(bad, psx::summary::Tail::stop), psx::summary_error);
      }
    }
  }
  SUBCASE("cut anywhere but between records") {
    for (std::size_t size = 1; size < file.size(); ++size) {
      write_bytes(bad, file.substr(0, size));
      const auto at = std::find(offsets.begin(), offsets.end(), size);
      if (at != offsets.end()) {
        CHECK(psx::summary::read_events(bad).size() == static_cast<std::size_t>(at - offsets.begin()));
        continue;
      }
      const auto next = std::upper_bound(offsets.begin(), offsets.end(), size);
      const std::size_t record = *(next - 1);
      const std::string e = read_error(bad);
      INFO("size " << size << ": " << e);
      CHECK(e.find("record at byte offset " + std::to_string(record) + ": truncated") != std::string::npos);
      // A reader of a file still being written takes the whole records.
      const auto whole = psx::summary::read_events(bad, psx::summary::Tail::stop);
      CHECK(whole.size() == static_cast<std::size_t>(next - 1 - offsets.begin()));
      if (!whole.empty()) CHECK(whole.back().step == static_cast<std::int64_t>(whole.size()) - 1);
    }
  }
  SUBCASE("a length CRC resealed over a huge length: no allocation, truncated") {
    std::string copy = file;
    const std::uint64_t huge = std::uint64_t{1} << 62;
    std::memcpy(copy.data() + offsets[2], &huge, 8);
    const std::uint32_t crc = psx::detail::masked_crc32c(std::string_view(copy.data() + offsets[2], 8));
    std::memcpy(copy.data() + offsets[2] + 8, &crc, 4);
    write_bytes(bad, copy);
    const std::string at = "record at byte offset " + std::to_string(offsets[2]) + ": ";
    CHECK(read_error(bad).find(at + "truncated: 4611686018427387904") != std::string::npos);
    CHECK(psx::summary::read_events(bad, psx::summary::Tail::stop).size() == 2);
  }
  SUBCASE("valid framing around malformed protobuf") {
    const auto sealed = [&](const std::string& data) {
      write_bytes(bad, file.substr(0, offsets[1]) + record(data));
      return read_error(bad);
    };
    const std::string at = "record at byte offset " + std::to_string(offsets[1]) + ": ";
    CHECK(sealed(std::string("\x10") + std::string(11, '\xff')).find(at + "malformed protobuf: a varint longer") !=
          std::string::npos);
    CHECK(sealed("\x10").find(at + "malformed protobuf: a varint runs past the end at byte 1") != std::string::npos);
    CHECK(sealed("\x2a\x04\x0a\x10" "ab").find("a length of 16 runs past the end") != std::string::npos);
    CHECK(sealed("\x0b").find("wire type 3") != std::string::npos);  // a group
    CHECK(sealed("\x09\x01\x02").find("fixed-width field runs past the end") != std::string::npos);
    CHECK(sealed(std::string(1, '\0')).find("field number 0") != std::string::npos);
    // A histogram with 1 limit and 0 buckets.
    const std::string histogram = "\x2a\x0f\x0a\x0d\x2a\x0b\x31" + std::string(8, '\0') + std::string("\x3a\x00", 2);
    CHECK(sealed(histogram).find("1 bucket limits but 0") != std::string::npos);
    // Packed doubles of 3 bytes.
    CHECK(sealed("\x2a\x09\x0a\x07\x2a\x05\x32\x03xyz").find("packed doubles of 3 bytes") != std::string::npos);
  }
  SUBCASE("unknown fields are skipped") {
    // graph_def (4, bytes), an unknown varint (20), fixed32 (21) and step 5.
    const std::string unknown("\x22\x02xy\xa0\x01\x07\xad\x01\x01\x02\x03\x04\x10\x05", 15);
    write_bytes(bad, file.substr(0, offsets[1]) + record(unknown));
    const auto events = psx::summary::read_events(bad);
    REQUIRE(events.size() == 2);
    CHECK(events[1].step == 5);
    CHECK(events[1].values.empty());
  }
  SUBCASE("missing file") {
    CHECK(read_error(dir.path / "none").find((dir.path / "none").string()) != std::string::npos);
  }
}

TEST_CASE("summary: mutated and random files are refused, never crash") {
  TempDir dir("psx-summary");
  fs::path good;
  {
    psx::SummaryWriter w(dir.path / "good");
    good = w.path();
    const std::vector<float> v = {1, -2, 3.5f, 1e-13f};
    w.histogram("h", v, 2);
    w.text("t", "text", 3);
    w.scalar("s", 1, 4);
  }
  const std::string file = bytes_of(good);
  const auto offsets = record_offsets(file);
  const fs::path bad = dir.path / "bad";
  std::mt19937_64 rng(12345);
  int refused = 0, read = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    // Mutate one record's data, then reseal its CRCs so the decoder sees it.
    const std::size_t r = 1 + rng() % (offsets.size() - 1);
    const std::size_t end = r + 1 < offsets.size() ? offsets[r + 1] : file.size();
    std::string data = file.substr(offsets[r] + 12, end - offsets[r] - 16);
    for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) {
      const std::size_t at = rng() % data.size();
      switch (rng() % 3) {
        case 0: data[at] = static_cast<char>(rng()); break;
        case 1: data.erase(at, 1 + rng() % 8); break;
        default: data.insert(at, 1 + rng() % 4, static_cast<char>(rng())); break;
      }
      if (data.empty()) data = "\x08";
    }
    if (iter % 10 == 0) {  // or random bytes altogether
      data.resize(rng() % 64);
      for (char& c : data) c = static_cast<char>(rng());
    }
    write_bytes(bad, file.substr(0, offsets[r]) + record(data) + file.substr(end));
    try {
      psx::summary::read_events(bad);
      ++read;
    } catch (const psx::summary_error& e) {
      ++refused;
      CHECK(std::string(e.what()).find("record at byte offset " + std::to_string(offsets[r])) != std::string::npos);
    }
  }
  CHECK(refused > 100);
  CHECK(read > 100);
  MESSAGE("summary fuzz: " << refused << " refused with summary_error, " << read << " read");
}

TEST_CASE("summary: a log directory that cannot be made is named") {
  TempDir dir("psx-summary");
  write_bytes(dir.path / "file", "x");
  const auto e = psx_test::message_of<psx::summary_error>([&] { psx::SummaryWriter w(dir.path / "file" / "run"); });
  CHECK(e.find((dir.path / "file" / "run").string()) != std::string::npos);
}

TEST_CASE("summary: the servers' counters as scalars, their load balance and one staleness histogram") {
  TempDir dir("psx-summary");
  std::vector<psx::ServerStats> servers(2);
  servers[0].requests = 10;
  servers[0].bytes_in = 300;
  servers[0].bytes_out = 100;
  servers[0].staleness.assign(psx::staleness_buckets, 0);
  servers[0].staleness[0] = 5;
  servers[0].staleness[2] = 1;
  servers[1].requests = 4;
  servers[1].bytes_in = 100;
  servers[1].slot_bytes = 64;
  servers[1].waiting = 3;
  servers[1].waiting_max = 5;
  servers[1].retried = 7;
  servers[1].duplicates = 2;
  servers[1].staleness.assign(psx::staleness_buckets, 0);
  servers[1].staleness[0] = 2;
  servers[1].staleness[psx::staleness_buckets - 1] = 1;  // 63 or more
  fs::path file;
  {
    psx::SummaryWriter w(dir.path);
    file = w.path();
    psx::summary::write_server_stats(w, servers, 12);
  }
  std::map<std::string, float> scalars;
  const psx::summary::Histogram* staleness = nullptr;
  const auto events = psx::summary::read_events(file);
  for (const auto& e : events)
    for (const auto& v : e.values) {
      CHECK(e.step == 12);
      if (v.kind == Value::Kind::scalar) scalars[v.tag] = v.scalar;
      if (v.kind == Value::Kind::histogram && v.tag == "servers/staleness") staleness = &v.histogram;
    }
  CHECK(scalars.size() == 2 * 15 + 1);
  CHECK(scalars.at("servers/1/waiting") == 3.0f);
  CHECK(scalars.at("servers/1/waiting_max") == 5.0f);
  CHECK(scalars.at("servers/1/retried") == 7.0f);
  CHECK(scalars.at("servers/1/duplicates") == 2.0f);
  CHECK(scalars.at("servers/0/waiting") == 0.0f);
  CHECK(scalars.at("servers/0/requests") == 10.0f);
  CHECK(scalars.at("servers/1/requests") == 4.0f);
  CHECK(scalars.at("servers/0/bytes_in") == 300.0f);
  CHECK(scalars.at("servers/1/slot_bytes") == 64.0f);
  CHECK(scalars.at("servers/1/bytes_out") == 0.0f);
  CHECK(scalars.at("servers/bytes_max_over_mean") == doctest::Approx(400.0 / 250.0));
  REQUIRE(staleness != nullptr);
  CHECK(staleness->num == 9.0);
  CHECK(staleness->min == 0.0);
  CHECK(staleness->max == 63.0);
  CHECK(staleness->sum == 2.0 + 63.0);
  REQUIRE(staleness->bucket.size() == psx::staleness_buckets);
  CHECK(staleness->bucket[0] == 7.0);
  CHECK(staleness->bucket[2] == 1.0);
  CHECK(staleness->bucket.back() == 1.0);
  CHECK(staleness->bucket_limit[0] == 0.5);
  CHECK(staleness->bucket_limit[2] == 2.5);
  CHECK(staleness->bucket_limit.back() == DBL_MAX);
}

TEST_CASE("summary: Progress says how far, how fast and how long still") {
  using namespace std::chrono_literals;
  const auto t0 = psx::summary::Progress::clock_type::time_point{} + 100s;
  psx::summary::Progress p(1500, "steps", t0);
  CHECK(p.rate() == 0.0);
  CHECK(std::isnan(p.eta_seconds()));
  CHECK(p.line() == "0/1500 steps (0.0%), 0 steps/s, 0.0 s elapsed, ETA -");
  p.update(250, t0 + 300ms);
  CHECK(p.rate() == doctest::Approx(250 / 0.3));
  CHECK(p.eta_seconds() == doctest::Approx(1250 / (250 / 0.3)));
  CHECK(p.line() == "250/1500 steps (16.7%), 833.3 steps/s, 0.3 s elapsed, ETA 1.5 s");
  p.update(1000, t0 + 2min);
  CHECK(p.line() == "1000/1500 steps (66.7%), 8.333 steps/s, 2m00s elapsed, ETA 1m00s");
  p.update(1500, t0 + 3h);
  CHECK(p.eta_seconds() == 0.0);
  CHECK(p.line() == "1500/1500 steps (100.0%), 0.1389 steps/s, 3h00m elapsed, ETA 0.0 s");
  // A clock that went backwards counts as no time passed.
  p.update(10, t0 - 1s);
  CHECK(p.elapsed_seconds() == 0.0);
  // A long unit is not cut short.
  const std::string unit(200, 'u');
  psx::summary::Progress longer(4, unit, t0);
  longer.update(2, t0 + 1s);
  CHECK(longer.line() == "2/4 " + unit + " (50.0%), 2 " + unit + "/s, 1.0 s elapsed, ETA 1.0 s");
  CHECK(psx::summary::Progress::duration(42.4) == "42 s");
  CHECK(psx::summary::Progress::duration(3725) == "1h02m");
  CHECK(psx::summary::Progress::duration(9.96) == "10 s");
  CHECK(psx::summary::Progress::duration(59.7) == "1m00s");
  CHECK(psx::summary::Progress::duration(3599.7) == "1h00m");
}
