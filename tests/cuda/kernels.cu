// Tests of psx/cuda/*.cuh against the CPU implementations: psx::optim (dense
// and row updates), a sequential dedup-and-sum, the CPU server's aggregate,
// psx::bfloat16 / psx::float16 and psx::quantize_int8.
//
// Without a CUDA device the program prints why and exits with 77 (ctest's
// SKIP_RETURN_CODE). PSX_CUDA_TESTS_QUICK=1 leaves out the ~1M sizes (for
// compute-sanitizer). Every kernel runs on fresh seeded inputs, sizes 0, 1,
// 3, 5, 1023, 4099 and ~1M, with 16-byte aligned and misaligned pointers;
// outputs that are not updated in place are poisoned first, so that an
// element left unwritten fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "device_main.hpp"

#include <psx/cuda/kernels.cuh>
#include <psx/half.hpp>
#include <psx/optim.hpp>
#include <psx/quantize.hpp>
#include <psx/schedule.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace pc = psx::cuda;

bool quick() {
  const char* q = std::getenv("PSX_CUDA_TESTS_QUICK");
  return q && *q && std::strcmp(q, "0") != 0;
}

// The sizes every kernel runs on: not multiples of the vector width, and a large one.
std::vector<std::size_t> sizes() {
  std::vector<std::size_t> s{0, 1, 3, 5, 1023, 4099};
  if (!quick()) s.push_back((std::size_t{1} << 20) + 3);
  return s;
}

std::uint64_t seed_of(const std::string& what, std::size_t a, std::size_t b = 0, std::size_t c = 0) {
  std::uint64_t h = 1469598103934665603ull;
  for (char ch : what) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  for (std::size_t x : {a, b, c}) h = (h ^ x) * 1099511628211ull;
  return h;
}

// Uniform in [lo, hi), never exactly 0.
std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do x = d(rng);
    while (x == 0.0f);
  }
  return v;
}

void sync() { pc::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

// A device array whose data starts `offset` elements into its allocation
// (offset 1 makes a float pointer 4 bytes off 16-byte alignment).
template <class T>
class Dev {
 public:
  Dev(std::size_t n, std::size_t offset) : buf_(n + offset), n_(n), offset_(offset) {}
  Dev(const std::vector<T>& host, std::size_t offset) : Dev(host.size(), offset) { upload(host); }
  T* ptr() { return buf_.data() ? buf_.data() + offset_ : nullptr; }
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    if (n_) pc::check(cudaMemcpy(ptr(), host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() {
    sync();
    std::vector<T> host(n_);
    if (n_) pc::check(cudaMemcpy(host.data(), ptr(), n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // Fills every byte with `byte` (0xff: NaN for floats).
  void poison(int byte = 0xff) {
    if (n_) pc::check(cudaMemset(ptr(), byte, n_ * sizeof(T)), "poison");
  }

 private:
  pc::buffer<T> buf_;
  std::size_t n_, offset_;
};

// Device copies of an optimizer's slots (each offset like the parameters),
// and the DeviceSlots view of them.
class DevSlots {
 public:
  DevSlots(const std::vector<std::vector<float>>& host, std::size_t offset) {
    slots_.reserve(host.size());
    for (const auto& s : host) slots_.emplace_back(s, offset);
  }
  pc::DeviceSlots view() {
    pc::DeviceSlots v{};
    v.count = slots_.size();
    for (std::size_t k = 0; k < slots_.size(); ++k) v.slot[k] = slots_[k].ptr();
    return v;
  }
  Dev<float>& operator[](std::size_t k) { return slots_[k]; }
  auto begin() { return slots_.begin(); }
  auto end() { return slots_.end(); }

 private:
  std::vector<Dev<float>> slots_;
};

// Compares a device result with the CPU's: NaN where the CPU has NaN, else
// within 1e-6 of the CPU tensor's largest magnitude. Counts the elements
// that are not bit-identical too.
struct Compare {
  std::size_t bad = 0, not_identical = 0, first_bad = 0;
  float got = 0.0f, want = 0.0f;
  double max_err = 0.0;
};

Compare compare(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  Compare c;
  REQUIRE(gpu.size() == cpu.size());
  double mag = 0.0;
  for (float x : cpu)
    if (std::isfinite(x)) mag = std::max(mag, static_cast<double>(std::fabs(x)));
  const double tol = 1e-6 * std::max(mag, 1e-30);
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    const float g = gpu[i], w = cpu[i];
    // NaN payloads differ between the CPU and the GPU: any NaN matches any NaN.
    if (std::bit_cast<std::uint32_t>(g) != std::bit_cast<std::uint32_t>(w) && !(std::isnan(g) && std::isnan(w)))
      ++c.not_identical;
    bool ok;
    if (std::isnan(w)) ok = std::isnan(g);
    else if (std::isinf(w)) ok = g == w;
    else {
      const double err = std::fabs(static_cast<double>(g) - static_cast<double>(w));
      ok = err <= tol;
      if (ok) c.max_err = std::max(c.max_err, mag > 0 ? err / mag : err);
    }
    if (!ok && c.bad++ == 0) {
      c.first_bad = i;
      c.got = g;
      c.want = w;
    }
  }
  return c;
}

template <class T>
std::string describe(const T& o) {
  std::ostringstream os;
  os << o;
  return os.str();
}

// Accumulates the bit-identity statistics of one optimizer configuration.
struct Tally {
  std::size_t elements = 0, not_identical = 0;
  double max_err = 0.0;
  void add(const Compare& c, std::size_t n) {
    elements += n;
    not_identical += c.not_identical;
    max_err = std::max(max_err, c.max_err);
  }
};

void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::string& what, Tally* t) {
  const Compare c = compare(gpu, cpu);
  if (t) t->add(c, cpu.size());
  CHECK_MESSAGE(c.bad == 0, what << ": " << c.bad << " of " << cpu.size() << " elements off; first at " << c.first_bad
                                 << ": device " << c.got << ", CPU " << c.want);
}

template <class T>
void expect_identical(const std::vector<T>& gpu, const std::vector<T>& cpu, const std::string& what) {
  REQUIRE(gpu.size() == cpu.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i)
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << cpu.size() << " elements not bit-identical, first at "
                               << first);
}

// --- optimizers ----------------------------------------------------------

struct Offsets {
  std::size_t params, grads;  // in floats; slots share the parameters' offset
};
constexpr Offsets offset_cases[] = {{0, 0}, {1, 1}, {0, 1}};

template <class O>
void check_dense(const O& o) {
  const std::string name = describe(o);
  const std::size_t ns = o.slots();
  Tally tally;
  for (const Offsets off : offset_cases) {
    for (std::size_t n : sizes()) {
      if (n > 100000 && off.params != off.grads) continue;  // the mixed case at small sizes only
      std::mt19937_64 rng(seed_of(name, n, off.params, off.grads));
      std::vector<float> w = random_floats(n, rng);
      std::vector<std::vector<float>> s(ns);
      for (std::size_t k = 0; k < ns; ++k) s[k].assign(n, psx::initial_slot(o, k));
      Dev<float> dw(w, off.params), dg(n, off.grads);
      DevSlots ds(s, off.params);
      const pc::DeviceSlots slots = ds.view();
      for (std::uint64_t step = 1; step <= 5; ++step) {
        const std::vector<float> g = random_floats(n, rng);
        dg.upload(g);
        psx::UpdateContext ctx;
        ctx.step = step;
        ctx.global_step = step + 2;
        ctx.lr_scale = 1.0 - 0.1 * static_cast<double>(step);
        std::vector<float*> bases(ns);
        for (std::size_t k = 0; k < ns; ++k) bases[k] = s[k].data();
        o.update(w, g, psx::SlotView(bases.data(), ns, 0, n), ctx);
        pc::update(o, dw.ptr(), dg.ptr(), slots, n, ctx);
        const std::string where = name + " n=" + std::to_string(n) + " offsets=" + std::to_string(off.params) + "/" +
                                  std::to_string(off.grads) + " step " + std::to_string(step);
        expect_close(dw.download(), w, where + " w", &tally);
        for (std::size_t k = 0; k < ns; ++k)
          expect_close(ds[k].download(), s[k], where + " slot " + std::to_string(k), &tally);
      }
    }
  }
  MESSAGE(name << " dense: max error " << tally.max_err << " of the max magnitude; " << tally.not_identical << " of "
               << tally.elements << " elements not bit-identical to the CPU");
}

// Row pushes: `num_rows` distinct rows of a larger table, steps at global
// steps 1, 2, 4, 7, 8; rows and slots not pushed must not change at all.
template <class O>
void check_rows(const O& o) {
  const std::string name = describe(o);
  const std::size_t ns = o.slots();
  Tally tally;
  std::vector<std::pair<std::size_t, std::size_t>> cases;  // (width, rows)
  for (std::size_t width : {1, 3, 4, 64})
    for (std::size_t rows : {0, 1, 3, 5, 1023, 4099}) cases.emplace_back(width, rows);
  if (!quick()) cases.emplace_back(64, 16411);  // ~1M elements
  const std::uint64_t global_steps[] = {1, 2, 4, 7, 8};
  for (const Offsets off : offset_cases) {
    for (auto [width, num_rows] : cases) {
      if (num_rows > 10000 && off.params != off.grads) continue;  // the mixed case at small sizes only
      std::mt19937_64 rng(seed_of(name + " rows", width, num_rows, off.params * 2 + off.grads));
      const std::size_t table_rows = 2 * num_rows + 7, n = table_rows * width;
      std::vector<float> table = random_floats(n, rng);
      std::vector<std::vector<float>> s(ns);
      for (std::size_t k = 0; k < ns; ++k) {
        s[k] = random_floats(n, rng, 0.0f, 0.01f);
        for (float& x : s[k]) x += psx::initial_slot(o, k);
      }
      Dev<float> dt(table, off.params), dg(num_rows * width, off.grads);
      Dev<std::uint64_t> dr(num_rows, 0);
      DevSlots ds(s, off.params);
      const pc::DeviceSlots slots = ds.view();
      std::vector<std::uint64_t> all(table_rows);
      std::iota(all.begin(), all.end(), 0);
      for (std::size_t step = 1; step <= 5; ++step) {
        std::shuffle(all.begin(), all.end(), rng);
        const std::vector<std::uint64_t> rows(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(num_rows));
        const std::vector<float> g = random_floats(num_rows * width, rng);
        dr.upload(rows);
        dg.upload(g);
        psx::UpdateContext ctx;
        ctx.step = step;
        ctx.global_step = global_steps[step - 1];
        ctx.rows = true;
        ctx.lr_scale = 0.75;
        std::vector<float*> bases(ns);
        for (std::size_t k = 0; k < ns; ++k) bases[k] = s[k].data();
        for (std::size_t k = 0; k < num_rows; ++k)
          o.update(std::span<float>(table.data() + rows[k] * width, width),
                   std::span<const float>(g.data() + k * width, width),
                   psx::SlotView(bases.data(), ns, rows[k] * width, width), ctx);
        // What the device held before, for the rows it must leave alone.
        std::vector<std::vector<float>> before{dt.download()};
        for (auto& d : ds) before.push_back(d.download());
        pc::update_rows(o, dt.ptr(), slots, width, dr.ptr(), dg.ptr(), num_rows, ctx);
        std::vector<std::vector<float>> after{dt.download()};
        for (auto& d : ds) after.push_back(d.download());
        const std::string where = name + " rows: width " + std::to_string(width) + ", " + std::to_string(num_rows) +
                                  " rows, offsets " + std::to_string(off.params) + "/" + std::to_string(off.grads) +
                                  ", step " + std::to_string(step);
        expect_close(after[0], table, where + " table", &tally);
        for (std::size_t k = 0; k < ns; ++k) expect_close(after[k + 1], s[k], where + " slot " + std::to_string(k), &tally);
        std::vector<char> pushed(table_rows, 0);
        for (std::uint64_t r : rows) pushed[r] = 1;
        std::size_t changed = 0;
        for (std::size_t a = 0; a < after.size(); ++a)
          for (std::size_t r = 0; r < table_rows; ++r)
            if (!pushed[r] && std::memcmp(after[a].data() + r * width, before[a].data() + r * width,
                                          width * sizeof(float)) != 0)
              ++changed;
        CHECK_MESSAGE(changed == 0, where << ": " << changed << " rows (of the table or a slot) changed though not pushed");
      }
    }
  }
  MESSAGE(name << " rows: max error " << tally.max_err << " of the max magnitude; " << tally.not_identical << " of "
               << tally.elements << " elements not bit-identical to the CPU");
}

}  // namespace

TEST_CASE("cuda: SGD, dense and rows") {
  psx::optim::SGD plain{.lr = 0.1};
  psx::optim::SGD decay{.lr = 0.1, .weight_decay = 0.01};
  psx::optim::SGD momentum{.lr = 0.05, .momentum = 0.9, .dampening = 0.1};
  psx::optim::SGD nesterov{.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 0.001};
  for (const auto& o : {plain, decay, momentum, nesterov}) {
    check_dense(o);
    check_rows(o);
  }
}

TEST_CASE("cuda: Adagrad, dense and rows") {
  psx::optim::Adagrad plain{.lr = 0.1};
  psx::optim::Adagrad full{.lr = 0.1, .lr_decay = 0.01, .weight_decay = 0.01, .initial_accumulator_value = 0.1};
  for (const auto& o : {plain, full}) {
    check_dense(o);
    check_rows(o);
  }
}

TEST_CASE("cuda: RMSProp, dense and rows") {
  psx::optim::RMSProp plain{.lr = 0.01};
  psx::optim::RMSProp centered{.lr = 0.01, .centered = true};
  psx::optim::RMSProp momentum{.lr = 0.01, .weight_decay = 0.01, .momentum = 0.9};
  psx::optim::RMSProp both{.lr = 0.01, .alpha = 0.9, .weight_decay = 0.01, .momentum = 0.5, .centered = true};
  for (const auto& o : {plain, centered, momentum, both}) {
    check_dense(o);
    check_rows(o);
  }
}

TEST_CASE("cuda: Adam and AdamW, dense and rows (SparseAdam)") {
  psx::optim::Adam adam{.lr = 0.01};
  psx::optim::Adam ams{.lr = 0.01, .weight_decay = 0.01, .amsgrad = true};
  for (const auto& o : {adam, ams}) {
    check_dense(o);
    check_rows(o);
  }
  psx::optim::AdamW adamw{.lr = 0.01, .weight_decay = 0.1};
  psx::optim::AdamW adamw_ams{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true};
  for (const auto& o : {adamw, adamw_ams}) {
    check_dense(o);
    check_rows(o);
  }
}

TEST_CASE("cuda: Ftrl, dense and rows") {
  psx::optim::Ftrl sqrt_power{.lr = 0.1, .l1 = 0.001, .l2 = 0.01};
  psx::optim::Ftrl other_power{.lr = 0.1, .lr_power = -0.7, .l1 = 0.001, .l2 = 0.01};
  for (const auto& o : {sqrt_power, other_power}) {
    check_dense(o);
    check_rows(o);
  }
}

TEST_CASE("cuda: Lamb, dense") {
  check_dense(psx::optim::Lamb{.lr = 0.01});
  check_dense(psx::optim::Lamb{.lr = 0.01, .weight_decay = 0.01});
}

TEST_CASE("cuda: a scheduled optimizer scales the learning rate as the CPU does") {
  const auto o = psx::optim::scheduled(psx::optim::Adam{.lr = 0.01}, psx::schedule::Exponential{.decay_steps = 2});
  check_dense(o);
  check_rows(o);
}

TEST_CASE("cuda: a wrong slot count is refused") {
  psx::cuda::DeviceSlots one{};
  one.count = 1;
  CHECK_THROWS_AS(pc::update(psx::optim::Adam{}, nullptr, nullptr, one, 0, psx::UpdateContext{}), psx::shape_error);
}

// --- sparse rows -----------------------------------------------------------

// Gathers `n` random rows of a `table_rows` x `width` table on the device
// (buffers `off` floats past alignment) and compares with the host's copy.
static void check_gather(std::size_t width, std::size_t n, std::size_t table_rows, std::size_t off, std::mt19937_64& rng,
                  const std::string& what) {
  const std::vector<float> table = random_floats(table_rows * width, rng);
  std::vector<std::uint64_t> ids(n);
  for (auto& id : ids) id = rng() % table_rows;
  Dev<float> dt(table, off), dout(n * width, off);
  Dev<std::uint64_t> di(ids, 0);
  dout.poison();
  pc::gather_rows(dt.ptr(), width, di.ptr(), n, dout.ptr());
  std::vector<float> want(n * width);
  for (std::size_t k = 0; k < n; ++k)
    std::copy_n(table.begin() + static_cast<std::ptrdiff_t>(ids[k] * width), width,
                want.begin() + static_cast<std::ptrdiff_t>(k * width));
  expect_identical(dout.download(), want, what);
}

TEST_CASE("cuda: gather_rows") {
  for (std::size_t width : {1, 3, 4, 64}) {
    for (std::size_t n : sizes()) {
      if (n > 5000 && width > 1) continue;  // ~1M elements: width 1 here, width 64 below
      for (std::size_t off : {0, 1}) {
        std::mt19937_64 rng(seed_of("gather", width, n, off));
        check_gather(width, n, n / 2 + 3, off, rng,
                     "gather_rows width " + std::to_string(width) + " n " + std::to_string(n) + " offset " +
                         std::to_string(off));
      }
    }
  }
  // ~1M elements with vector loads: 16411 rows of 64.
  if (!quick()) {
    std::mt19937_64 rng(seed_of("gather large", 0));
    check_gather(64, 16411, 40000, 0, rng, "gather_rows large");
  }
}

namespace {

// The CPU reference: unique ids ascending, each with its rows summed in
// push order (the first row copied, the others added), as RowAccumulator.
struct DedupRef {
  std::vector<std::uint64_t> ids;
  std::vector<std::uint32_t> counts;
  std::vector<float> sums;
};

DedupRef dedup_ref(const std::vector<std::uint64_t>& ids, const std::vector<float>& grads, std::size_t width) {
  std::vector<std::size_t> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ids[a] < ids[b]; });
  DedupRef r;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::size_t p = order[i];
    const float* row = grads.data() + p * width;
    if (i == 0 || ids[p] != r.ids.back()) {
      r.ids.push_back(ids[p]);
      r.counts.push_back(1);
      r.sums.insert(r.sums.end(), row, row + width);
    } else {
      ++r.counts.back();
      float* sum = r.sums.data() + (r.ids.size() - 1) * width;
      for (std::size_t j = 0; j < width; ++j) sum[j] += row[j];
    }
  }
  return r;
}

enum class IdMix { spread, hot };

void check_dedup(pc::RowDedup& dedup, std::size_t n, std::size_t width, IdMix mix, std::size_t off, int end_bit) {
  std::mt19937_64 rng(seed_of("dedup", n, width, off * 4 + (mix == IdMix::hot ? 2 : 0) + (end_bit < 64)));
  std::vector<std::uint64_t> ids(n);
  const std::uint64_t range = std::max<std::size_t>(1, n / 3);
  const std::uint64_t mask = end_bit == 64 ? ~0ull : (1ull << end_bit) - 1;
  for (auto& id : ids) {
    // Spread the small values over all the key bits (an odd multiplier is a bijection).
    const std::uint64_t v = (mix == IdMix::hot && rng() % 2 == 0) ? 12345 : rng() % range;
    id = (v * 0x9E3779B97F4A7C15ull) & mask;
  }
  const std::vector<float> grads = random_floats(n * width, rng);
  const DedupRef want = dedup_ref(ids, grads, width);
  Dev<std::uint64_t> di(ids, 0);
  Dev<float> dg(grads, off);
  const std::string where = "RowDedup n " + std::to_string(n) + " width " + std::to_string(width) +
                            (mix == IdMix::hot ? " hot" : " spread") + " offset " + std::to_string(off) +
                            " end_bit " + std::to_string(end_bit);
  // First run allocates; poison its outputs, then run again into them.
  std::size_t u = dedup.run(di.ptr(), dg.ptr(), n, width, 0, end_bit);
  REQUIRE_MESSAGE(u == want.ids.size(), where);
  if (u > 0) {
    pc::check(cudaMemset(const_cast<std::uint64_t*>(dedup.unique_ids()), 0xff, u * sizeof(std::uint64_t)), "poison");
    if (width > 0)
      pc::check(cudaMemset(const_cast<float*>(dedup.sums()), 0xff, u * width * sizeof(float)), "poison");
  }
  u = dedup.run(di.ptr(), dg.ptr(), n, width, 0, end_bit);
  REQUIRE_MESSAGE(u == want.ids.size(), where);
  REQUIRE(dedup.size() == u);
  sync();
  std::vector<std::uint64_t> got_ids(u);
  std::vector<std::uint32_t> got_counts(u);
  std::vector<float> got_sums(u * width);
  if (u) {
    pc::check(cudaMemcpy(got_ids.data(), dedup.unique_ids(), u * 8, cudaMemcpyDeviceToHost), "download");
    pc::check(cudaMemcpy(got_counts.data(), dedup.counts(), u * 4, cudaMemcpyDeviceToHost), "download");
    if (width)
      pc::check(cudaMemcpy(got_sums.data(), dedup.sums(), u * width * 4, cudaMemcpyDeviceToHost), "download");
  }
  expect_identical(got_ids, want.ids, where + " ids");
  expect_identical(got_counts, want.counts, where + " counts");
  expect_identical(got_sums, want.sums, where + " sums");
}

}  // namespace

TEST_CASE("cuda: RowDedup sums each id's rows in push order") {
  pc::RowDedup dedup;  // one for all: its memory is reused and grown
  for (std::size_t n : sizes())
    for (std::size_t width : {1, 3, 64})
      for (IdMix mix : {IdMix::spread, IdMix::hot})
        for (std::size_t off : {0, 1}) {
          if (n > 5000 && width == 3) continue;
          check_dedup(dedup, n, width, mix, off, 64);
        }
  check_dedup(dedup, 4099, 64, IdMix::hot, 0, 20);  // fewer key bits
  check_dedup(dedup, 300, 4100, IdMix::hot, 0, 64);  // rows too wide for the staged kernel
  check_dedup(dedup, 1023, 0, IdMix::hot, 0, 64);    // no columns
}

// --- aggregation -------------------------------------------------------------

TEST_CASE("cuda: aggregate sums in worker order, then divides as the CPU's mean") {
  for (std::size_t k : {1, 2, 3, 8, 17}) {
    for (std::size_t n : sizes()) {
      if (k == 17 && n > 5000) continue;
      for (bool mean : {false, true}) {
        for (std::size_t off : {0, 1}) {
          std::mt19937_64 rng(seed_of("aggregate", k, n, off * 2 + mean));
          std::vector<std::vector<float>> g(k);
          std::vector<Dev<float>> dg;
          dg.reserve(k);
          std::vector<const float*> ptrs(k);
          for (std::size_t j = 0; j < k; ++j) {
            g[j] = random_floats(n, rng, -100.0f, 100.0f);
            dg.emplace_back(g[j], j % 2 == 0 ? off : 0);
            ptrs[j] = dg[j].ptr();
          }
          // The CPU server: the first gradient moved in, the others added, then `x /= d`.
          std::vector<float> want = g[0];
          for (std::size_t j = 1; j < k; ++j)
            for (std::size_t i = 0; i < n; ++i) want[i] += g[j][i];
          const float d = mean ? static_cast<float>(k) : 1.0f;
          if (mean)
            for (float& x : want) x /= d;
          Dev<float> dout(n, off);
          dout.poison();
          pc::aggregate(ptrs.data(), k, n, dout.ptr(), d);
          expect_identical(dout.download(), want,
                           "aggregate k " + std::to_string(k) + " n " + std::to_string(n) + (mean ? " mean" : " sum") +
                               " offset " + std::to_string(off));
        }
      }
    }
  }
  CHECK_THROWS_AS(pc::aggregate(nullptr, 0, 10, nullptr, 1.0f), psx::shape_error);
}

// --- conversions -------------------------------------------------------------

namespace {

// Random bit patterns (every class: normal, subnormal, zero, infinity, NaN)
// and the values around the rounding boundaries of both 16-bit formats.
std::vector<float> conversion_inputs(std::size_t n, std::mt19937_64& rng) {
  static const std::uint32_t special[] = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001,
                                          0x7f800001, 0x7fbfffff, 0x00000001, 0x807fffff, 0x477fefff, 0x477ff000,
                                          0x38800000, 0x387fffff, 0x33000000, 0x33000001, 0x3f808000, 0x3f818000,
                                          0x7f7fffff, 0x3f7fffff, 0xc77fe000, 0x37ffe000};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    if (i < std::size(special)) bits = special[i];
    else if (i % 3 == 0) bits = static_cast<std::uint32_t>(rng());
    else bits = std::bit_cast<std::uint32_t>(std::uniform_real_distribution<float>(-70000.0f, 70000.0f)(rng)) ^
                static_cast<std::uint32_t>(rng() & 0x1fff);  // low bits at random: ties and near-ties
    v[i] = std::bit_cast<float>(bits);
  }
  return v;
}

template <class H>
void check_half_conversions(const char* name) {
  for (std::size_t n : sizes()) {
    for (std::size_t off : {0, 1}) {
      std::mt19937_64 rng(seed_of(name, n, off));
      const std::vector<float> x = conversion_inputs(n, rng);
      Dev<float> dx(x, off);
      Dev<H> dh(n, off);
      dh.poison();
      pc::convert(dx.ptr(), dh.ptr(), n);
      std::vector<H> want(n);
      for (std::size_t i = 0; i < n; ++i) want[i] = H::from_float(x[i]);
      const std::vector<H> got = dh.download();
      expect_identical(got, want, std::string(name) + " from float, n " + std::to_string(n) + " offset " +
                                      std::to_string(off));
      // And back, from every pattern the forward pass made.
      Dev<float> dy(n, off);
      dy.poison();
      pc::convert(dh.ptr(), dy.ptr(), n);
      std::vector<float> back(n);
      for (std::size_t i = 0; i < n; ++i) back[i] = want[i].to_float();
      expect_identical(dy.download(), back, std::string(name) + " to float, n " + std::to_string(n) + " offset " +
                                                std::to_string(off));
    }
  }
  // Every 16-bit pattern to float.
  std::vector<H> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = static_cast<std::uint16_t>(i);
  Dev<H> dh(all, 0);
  Dev<float> dy(all.size(), 0);
  dy.poison();
  pc::convert(dh.ptr(), dy.ptr(), all.size());
  std::vector<float> want(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) want[i] = all[i].to_float();
  expect_identical(dy.download(), want, std::string(name) + ": every 16-bit pattern to float");
}

}  // namespace

TEST_CASE("cuda: bfloat16 conversions are bit-identical to psx::bfloat16") {
  check_half_conversions<psx::bfloat16>("bfloat16");
}

TEST_CASE("cuda: float16 conversions are bit-identical to psx::float16") {
  check_half_conversions<psx::float16>("float16");
}

// --- int8 quantization -------------------------------------------------------

namespace {

void check_int8(const std::vector<float>& x, std::size_t rows, std::size_t width, bool per_channel, std::size_t off,
                const std::string& what) {
  const psx::QuantizedInt8 want = psx::quantize_int8(x, rows, width, per_channel);
  Dev<float> dx(x, off);
  Dev<std::int8_t> dq(x.size(), off);
  Dev<float> ds(want.scales.size(), 0);
  dq.poison(0x80);  // -128: never produced
  ds.poison();
  pc::quantize_int8(dx.ptr(), rows, width, per_channel, dq.ptr(), ds.ptr());
  const std::string where = what + (per_channel ? " per channel" : " per tensor") + " offset " + std::to_string(off);
  expect_identical(dq.download(), want.values, where + " values");
  expect_identical(ds.download(), want.scales, where + " scales");
  std::vector<float> back(x.size());
  psx::dequantize(want, back);
  Dev<float> dy(x.size(), off);
  dy.poison();
  pc::dequantize_int8(dq.ptr(), ds.ptr(), rows, width, per_channel, dy.ptr());
  expect_identical(dy.download(), back, where + " dequantized");
}

}  // namespace

TEST_CASE("cuda: int8 quantization equals psx::quantize_int8") {
  std::vector<std::pair<std::size_t, std::size_t>> shapes{{0, 0},    {0, 5},    {3, 0},  {1, 1},   {1, 3},   {5, 1},
                                                          {3, 5},    {1, 1023}, {1, 4099}, {33, 1023}, {4099, 4}, {7, 64},
                                                          {9, 1024}, {2, 4104}, {3, 2052}};
  if (!quick()) shapes.emplace_back(1025, 1023);  // ~1M
  for (auto [rows, width] : shapes)
    for (bool per_channel : {false, true})
      for (std::size_t off : {0, 1}) {
        std::mt19937_64 rng(seed_of("int8", rows, width, off * 2 + per_channel));
        std::vector<float> x = random_floats(rows * width, rng, -3.0f, 3.0f);
        // Rows of different ranges, so that per-channel scales differ.
        for (std::size_t r = 0; r < rows; ++r)
          for (std::size_t j = 0; j < width; ++j) x[r * width + j] *= static_cast<float>(1 + r % 7);
        check_int8(x, rows, width, per_channel, off,
                   "int8 " + std::to_string(rows) + "x" + std::to_string(width));
      }
  // Ties round to even; an all-zero row gets scale 1; NaN quantizes to 0.
  const std::vector<float> ties{127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 126.5f, -127.0f};
  check_int8(ties, 1, ties.size(), false, 0, "int8 ties");
  const psx::QuantizedInt8 q = psx::quantize_int8(ties, 1, ties.size(), false);
  CHECK(q.scales[0] == 1.0f);
  CHECK(std::vector<int>(q.values.begin(), q.values.end()) == std::vector<int>{127, 0, 2, 2, 0, -2, 126, -127});
  const std::vector<float> zeros_and_nan{0.0f, 0.0f, 0.0f, 1.0f, std::nanf(""), -2.0f};
  check_int8(zeros_and_nan, 2, 3, true, 0, "int8 zeros and NaN");
  // A max below 127 x FLT_MIN (subnormal, or nearly): the scale stays FLT_MIN.
  const std::vector<float> tiny{5.04e-44f, -2.0e-44f, 0.0f, 1.0e-37f, -3.0e-38f, 1.5e-45f};
  check_int8(tiny, 2, 3, true, 0, "int8 tiny");
  check_int8(tiny, 2, 3, false, 0, "int8 tiny, per tensor");
  // max |x| = FLT_MAX: the scale one step below FLT_MAX / 127, as on the host.
  const std::vector<float> huge{FLT_MAX, -FLT_MAX, 1.0f, 2.0f};
  check_int8(huge, 2, 2, true, 0, "int8 FLT_MAX");
  check_int8(huge, 2, 2, false, 0, "int8 FLT_MAX, per tensor");
  CHECK_THROWS_AS(psx::quantize_int8(ties, 3, 3, false), psx::shape_error);
}

int main(int argc, char** argv) {
  return psx_test::cuda_test_main(argc, argv, "psx cuda tests", quick() ? ", quick sizes" : "");
}
