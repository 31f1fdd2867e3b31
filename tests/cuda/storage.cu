// Tests of psx::cuda::Device, the GPU storage of a ParameterServer: the same
// training on host storage and on device storage must end bit-identical (the
// kernels round each operation as the CPU does, and rows are summed in push
// order; LAMB, whose norms are summed in another order, is not here), for every
// optimizer, dense and sparse pushes, synchronous (rows summed on the host)
// and asynchronous (rows deduplicated on the device) policies, pulls into
// host and device buffers, and 16-bit variables.
//
// Without a CUDA device the program prints why and exits with 77 (ctest's
// SKIP_RETURN_CODE).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <psx/cuda/storage.cuh>
#include <psx/psx.hpp>
#include "../splitmix.hpp"
#include "device_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kRows = 300, kWidth = 20, kDense = 1000, kSteps = 12;

using psx_test::Splitmix64;

double scaled_error(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 0.0, worst = 0.0;
  for (float x : want) scale = std::max(scale, static_cast<double>(std::abs(x)));
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) / std::max(scale, 1e-30));
  return worst;
}

// Trains 2 workers for kSteps on a dense and a sparse variable (RowRange over
// 3 servers, so rows arrive with positions) and returns both variables.
template <class Storage, class S, class O>
std::pair<std::vector<float>, std::vector<float>> train(const S& sync, const O& opt) {
  psx::ParameterServer<psx::partition::RowRange, S, O, psx::transport::InProcess, Storage> ps({3, 2}, {}, sync, opt);
  ps.declare(psx::dense("w", {kDense}, psx::Initializer::uniform(-1, 1, 1)));
  ps.declare(psx::sparse("e", kRows, kWidth, psx::Initializer::normal(0, 0.5f, 2)));
  ps.run([](psx::Worker& w) {
    Splitmix64 rng{100 + w.index()};
    std::vector<float> dense(kDense), g(kDense);
    for (std::size_t step = 0; step < kSteps; ++step) {
      w.pull("w", dense);
      for (std::size_t i = 0; i < kDense; ++i) g[i] = rng.uniform() + 0.01f * dense[i];
      // Repeated ids on purpose: the storage must sum them.
      std::vector<std::uint64_t> ids(64);
      for (auto& id : ids) id = rng.next() % kRows;
      std::vector<float> rows(ids.size() * kWidth);
      w.pull_rows("e", ids, rows);
      for (float& x : rows) x = rng.uniform() * 0.5f + 0.1f * x;
      w.push("w", g);
      w.push_rows("e", ids, rows);
      w.step();
    }
  });
  return {ps.read("w"), ps.read("e")};
}

template <class S, class O>
void same_on_device(const S& sync, const O& opt) {
  INFO(opt << " with " << sync);
  const auto host = train<psx::storage::Host>(sync, opt);
  const auto device = train<psx::cuda::Device>(sync, opt);
  const double dense = scaled_error(device.first, host.first), sparse = scaled_error(device.second, host.second);
  MESSAGE(opt << ", " << sync << ": dense " << dense << ", rows " << sparse);
  CHECK(device.first == host.first);
  CHECK(device.second == host.second);
}

TEST_CASE("cuda::Device trains like host storage, every optimizer, synchronous (rows summed on the host)") {
  const psx::sync::Synchronous bsp{};
  same_on_device(bsp, psx::optim::SGD{0.05, 0.9, 0.0, true, 0.01});
  same_on_device(bsp, psx::optim::Adagrad{0.1, 0.01, 0.0, 0.1});
  same_on_device(bsp, psx::optim::RMSProp{0.01, 0.9, 1e-8, 0.01, 0.5, true});
  same_on_device(bsp, psx::optim::Adam{0.01, 0.9, 0.999, 1e-8, 0.0, true});
  same_on_device(bsp, psx::optim::AdamW{0.01});
  same_on_device(bsp, psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01});
  same_on_device(bsp, psx::optim::scheduled(psx::optim::Adam{0.01}, psx::schedule::Cosine{10, 0.1}));
}

TEST_CASE("cuda::Device trains like host storage, asynchronous (rows deduplicated on the device)") {
  // One worker so that the order of pushes, hence the result, is fixed.
  auto one_worker = [](const auto& opt) {
    using O = std::decay_t<decltype(opt)>;
    auto run = [&]<class Storage>(Storage) {
      psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, O, psx::transport::InProcess, Storage>
          ps({2, 1}, {}, {}, opt);
      ps.declare(psx::sparse("e", kRows, kWidth, psx::Initializer::normal(0, 0.5f, 2)));
      ps.start();
      psx::Worker w = ps.worker(0);
      Splitmix64 rng{7};
      for (std::size_t step = 0; step < kSteps; ++step) {
        std::vector<std::uint64_t> ids(500);
        for (auto& id : ids) id = rng.next() % 40 + (rng.next() % 2) * 200;  // few rows, many repeats, both shards
        std::vector<float> g(ids.size() * kWidth);
        for (float& x : g) x = rng.uniform();
        w.push_rows("e", ids, g);
        w.step();
      }
      return ps.read("e");
    };
    const auto host = run(psx::storage::Host{});
    const auto device = run(psx::cuda::Device{});
    const double e = scaled_error(device, host);
    MESSAGE(opt << ", asynchronous rows: " << e);
    CHECK(device == host);
  };
  one_worker(psx::optim::Adam{0.01});
  one_worker(psx::optim::Adagrad{0.1});
  one_worker(psx::optim::SGD{0.1, 0.9});
  one_worker(psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01});
}

TEST_CASE("cuda::Device serves pulls into device buffers, 16-bit copies, and reports its bytes") {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adam, psx::transport::InProcess,
                       psx::cuda::Device>
      ps({2, 1}, {}, {}, {0.01});
  psx::VariableSpec e = psx::sparse("e", 50, 8, psx::Initializer::uniform(-2, 2, 3));
  e.dtype = psx::DType::bfloat16;
  ps.declare(e);
  ps.start();
  psx::Worker w = ps.worker(0);
  const std::vector<std::uint64_t> ids{49, 3, 30, 3};
  std::vector<float> g(ids.size() * 8, 0.25f);
  w.push_rows("e", ids, g);
  w.step();
  const std::vector<float> master = ps.read("e");

  // Rows into a device buffer (the scatter kernel), then back.
  psx::cuda::buffer<float> on_device(ids.size() * 8);
  w.pull_rows("e", ids, std::span<float>(on_device.data(), on_device.size()));
  std::vector<float> back(ids.size() * 8);
  on_device.copy_to(back);
  for (std::size_t j = 0; j < ids.size(); ++j)
    for (std::size_t k = 0; k < 8; ++k) CHECK(back[j * 8 + k] == master[ids[j] * 8 + k]);

  // The 16-bit copy of updated and untouched rows.
  std::vector<psx::bfloat16> low(ids.size() * 8);
  w.pull_rows("e", ids, std::span(low));
  for (std::size_t j = 0; j < ids.size(); ++j)
    for (std::size_t k = 0; k < 8; ++k) CHECK(low[j * 8 + k] == psx::bfloat16::from_float(master[ids[j] * 8 + k]));
  std::vector<psx::bfloat16> all(50 * 8);
  w.pull("e", std::span(all));
  for (std::size_t i = 0; i < all.size(); ++i) CHECK(all[i] == psx::bfloat16::from_float(master[i]));

  // A gradient in device memory is refused before anything changes.
  const std::vector<float> before = ps.read("e");
  psx::cuda::buffer<float> device_grad(8);
  const std::vector<std::uint64_t> one{7};
  try {
    w.push_rows("e", one, std::span<const float>(device_grad.data(), 8));
    FAIL("a device-memory gradient was accepted");
  } catch (const psx::config_error& err) {
    CHECK(std::string(err.what()).find("the gradient is in device memory") != std::string::npos);
  }
  CHECK(ps.read("e") == before);

  const psx::ServerStats st = ps.stats();
  CHECK(st.slot_bytes == 50 * 8 * 2 * sizeof(float));
  CHECK(st.parameter_bytes == 50 * 8 * (sizeof(float) + 2));
}

TEST_CASE("cuda::Staging moves pageable memory in chunks and never splits an item") {
  psx::cuda::Staging staging;
  cudaStream_t stream = nullptr;
  psx::cuda::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  auto check_items = [&](std::size_t count, std::size_t item_bytes) {
    INFO(count << " items of " << item_bytes << " bytes");
    std::vector<unsigned char> host(count * item_bytes);
    Splitmix64 rng{count + item_bytes};
    for (auto& b : host) b = static_cast<unsigned char>(rng.next());
    psx::cuda::buffer<unsigned char> dev(host.size());
    std::size_t next = 0, calls = 0;
    bool whole = true;
    staging.upload(dev.data(), count, item_bytes, stream, [&](std::size_t begin, std::size_t end, unsigned char* out) {
      whole = whole && begin == next && end > begin;  // in order, no gap, never empty
      next = end;
      ++calls;
      std::memcpy(out, host.data() + begin * item_bytes, (end - begin) * item_bytes);
    });
    psx::cuda::check(cudaStreamSynchronize(stream), "upload");
    CHECK(whole);
    CHECK(next == count);
    const std::size_t per = std::max<std::size_t>(1, psx::cuda::Staging::chunk_bytes / item_bytes);
    CHECK(calls == (count + per - 1) / per);
    std::vector<unsigned char> back(host.size(), 0);
    dev.copy_to(back);
    CHECK(back == host);

    std::vector<unsigned char> down(host.size(), 0);
    next = 0;
    calls = 0;
    staging.download(dev.data(), count, item_bytes, stream,
                     [&](std::size_t begin, std::size_t end, const unsigned char* in) {
                       whole = whole && begin == next && end > begin;
                       next = end;
                       ++calls;
                       std::memcpy(down.data() + begin * item_bytes, in, (end - begin) * item_bytes);
                     });
    CHECK(whole);
    CHECK(next == count);
    CHECK(calls == (count + per - 1) / per);
    CHECK(down == host);
  };
  check_items(0, 8);
  check_items(1, 1);
  check_items(1'000'003, 12);                                   // 3 chunks, the last one partial
  check_items(3, psx::cuda::Staging::chunk_bytes + 4096);      // items larger than a chunk
  check_items(2 * psx::cuda::Staging::chunk_bytes, 1);          // exactly two chunks
  cudaStreamDestroy(stream);
}

// Pinned host memory holding a copy of `v`.
psx::cuda::pinned_buffer<float> pinned_copy(const std::vector<float>& v) {
  psx::cuda::pinned_buffer<float> p(v.size());
  std::copy(v.begin(), v.end(), p.data());
  return p;
}

TEST_CASE("cuda::Device moves tensors larger than a staging chunk, from and to pageable, pinned and device memory") {
  // 9M parameters and pushes of 120000 rows of 64 over 3 servers: each
  // server's part of a dense transfer (12 MB) and of a row transfer (about
  // 40000 rows, 10 MB, with positions) spans three staging chunks. The same
  // steps on host storage must give the same bits.
  constexpr std::size_t n = 9'000'001, rows = 150'000, width = 64, count = 120'000;
  static_assert(n / 3 * sizeof(float) > 2 * psx::cuda::Staging::chunk_bytes);
  static_assert(count / 3 * width * sizeof(float) > 2 * psx::cuda::Staging::chunk_bytes);
  Splitmix64 rng{11};
  std::vector<float> g(n);
  for (float& x : g) x = rng.uniform() - 0.5f;
  std::vector<std::uint64_t> ids(count);
  for (auto& id : ids) id = rng.next() % rows;
  std::vector<float> rg(count * width);
  for (float& x : rg) x = rng.uniform() - 0.5f;

  auto train = [&]<class Storage>(Storage, std::span<const float> dense_grad, std::span<const float> row_grads,
                                  auto&& check_pulls) {
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::Adam,
                         psx::transport::InProcess, Storage>
        ps({3, 1}, {}, {}, {0.01});
    ps.declare(psx::dense("w", {n}, psx::Initializer::uniform(-1, 1, 5)));
    ps.declare(psx::sparse("e", rows, width, psx::Initializer::normal(0, 0.5f, 6)));
    ps.start();
    psx::Worker w = ps.worker(0);
    for (int step = 0; step < 2; ++step) {
      w.push("w", dense_grad);
      w.push_rows("e", ids, row_grads);
      w.step();
    }
    check_pulls(w);
    w.leave();
    return std::pair{ps.read("w"), ps.read("e")};
  };
  const auto host = train(psx::storage::Host{}, g, rg, [](psx::Worker&) {});
  auto rows_match = [&](const float* pulled) {
    for (std::size_t j = 0; j < count; ++j)
      if (!std::equal(pulled + j * width, pulled + (j + 1) * width, host.second.begin() + ids[j] * width)) return false;
    return true;
  };
  // Pushes from pageable memory; pulls into pageable, pinned and device memory.
  const auto device = train(psx::cuda::Device{}, g, rg, [&](psx::Worker& w) {
    std::vector<float> dense(n);
    w.pull("w", dense);
    CHECK(dense == host.first);
    std::vector<float> pulled(count * width);
    w.pull_rows("e", ids, pulled);
    CHECK(rows_match(pulled.data()));

    psx::cuda::pinned_buffer<float> pinned_dense = pinned_copy(std::vector<float>(n, 0.0f)),
                                    pinned_rows = pinned_copy(std::vector<float>(count * width, 0.0f));
    w.pull("w", pinned_dense.span());
    CHECK(std::equal(pinned_dense.data(), pinned_dense.data() + n, host.first.begin()));
    w.pull_rows("e", ids, pinned_rows.span());  // scattered by a kernel over the bus
    CHECK(rows_match(pinned_rows.data()));

    psx::cuda::buffer<float> on_device(n);
    w.pull("w", std::span<float>(on_device.data(), n));
    std::vector<float> back(n);
    on_device.copy_to(back);
    CHECK(back == host.first);
  });
  CHECK(device.first == host.first);
  CHECK(device.second == host.second);

  // Pushes from pinned memory: dense copied directly, rows gathered by a kernel over the bus.
  const psx::cuda::pinned_buffer<float> pg = pinned_copy(g), prg = pinned_copy(rg);
  const float* p = prg.data();
  CHECK(psx::cuda::memory_kind(p) == psx::cuda::MemoryKind::pinned);
  CHECK(psx::cuda::memory_kind(p + 12345) == psx::cuda::MemoryKind::pinned);
  CHECK(psx::cuda::memory_kind(rg.data()) == psx::cuda::MemoryKind::pageable);
  CHECK(psx::cuda::mapped_pointer(p) != nullptr);  // else the kernels' path is not the one tested
  CHECK(psx::cuda::mapped_pointer(p + 12345) ==
        static_cast<unsigned char*>(psx::cuda::mapped_pointer(p)) + 12345 * sizeof(float));
  CHECK(psx::cuda::mapped_pointer(rg.data()) == nullptr);
  const auto from_pinned = train(psx::cuda::Device{}, pg.span(), prg.span(), [](psx::Worker&) {});
  CHECK(from_pinned.first == host.first);
  CHECK(from_pinned.second == host.second);
}

TEST_CASE("cuda::Device refuses delay compensation, which reads parameters on the host") {
  using PS = psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::SGD,
                                  psx::transport::InProcess, psx::cuda::Device>;
  PS ps({1, 1}, {}, psx::sync::Asynchronous{.delay_compensation = 0.5f}, {0.1});
  ps.declare(psx::dense("w", {4}));
  try {
    ps.start();
    FAIL("start() accepted delay compensation on device storage");
  } catch (const psx::config_error& e) {
    CHECK(std::string(e.what()) == "psx: server 0: variable 'w': delay compensation reads parameters on the host; "
                                   "this storage keeps them elsewhere");
  }
}

}  // namespace

int main(int argc, char** argv) { return psx_test::cuda_test_main(argc, argv, "psx cuda storage tests"); }
