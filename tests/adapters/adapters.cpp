// Tests of psx/eigen.hpp and psx/xtensor.hpp: tensors filled and read in
// place, shapes checked, column-major storage refused.
#include "../support.hpp"

#include <psx/eigen.hpp>
#include <psx/psx.hpp>
#include <psx/xtensor.hpp>

#include <Eigen/Core>
#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xtensor.hpp>

#include <vector>

using psx_test::message_of;

namespace {
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Fixture {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous> ps{{2, 1}, {}, {}, {1.0f}};
  std::vector<float> init;
  Fixture() {
    ps.declare(psx::dense("w", {4, 3}, psx::Initializer::uniform(0, 1, 9)));
    ps.declare(psx::dense("b", {3}, psx::Initializer::constant(0.5f)));
    init = ps.read("w");
  }
};
}  // namespace

TEST_CASE_FIXTURE(Fixture, "Eigen row-major matrices, vectors and maps are pulled and pushed in place") {
  auto w = ps.worker(0);
  RowMatrix m(4, 3);
  w.pull("w", m);
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 3; ++c) CHECK(m(r, c) == init[static_cast<std::size_t>(r * 3 + c)]);

  Eigen::Matrix<float, 4, 3, Eigen::RowMajor> fixed;
  w.pull("w", fixed);
  CHECK(fixed == m);

  Eigen::VectorXf b(3);
  w.pull("b", b);
  CHECK(b == Eigen::VectorXf::Constant(3, 0.5f));
  const Eigen::VectorXf gb = Eigen::VectorXf::Ones(3);
  w.push("b", gb);
  w.pull("b", b);
  CHECK(b == Eigen::VectorXf::Constant(3, -0.5f));

  std::vector<float> storage(12, 0.0f);
  Eigen::Map<RowMatrix> view(storage.data(), 4, 3);
  w.pull("w", view);  // fills the vector behind the map
  CHECK(storage == init);

  Eigen::RowVectorXf flat(12);
  w.pull("w", flat);  // flat, same element count
  CHECK(flat(5) == init[5]);
}

TEST_CASE_FIXTURE(Fixture, "Eigen tensors of the wrong shape or column-major storage are refused") {
  auto w = ps.worker(0);
  RowMatrix wrong(3, 4);
  CHECK(message_of<psx::shape_error>([&] { w.pull("w", wrong); }) ==
        "psx: worker 0: pull of variable 'w' of shape [4, 3] with a tensor of shape [3, 4]");
  Eigen::MatrixXf col_major(4, 3);
  CHECK(message_of<psx::shape_error>([&] { w.pull("w", col_major); })
            .starts_with("psx: worker 0: pull of variable 'w': an Eigen 4x3 column-major matrix cannot be viewed"));
  CHECK(ps.read("w") == init);  // nothing written
}

TEST_CASE_FIXTURE(Fixture, "xtensor containers and adaptors are pulled and pushed in place") {
  auto w = ps.worker(0);
  xt::xarray<float> a = xt::zeros<float>({4, 3});
  w.pull("w", a);
  CHECK(a(2, 1) == init[7]);

  xt::xtensor<float, 2> g = xt::ones<float>({4, 3});
  w.push("w", g);
  xt::xtensor<float, 2> t = xt::zeros<float>({4, 3});
  w.pull("w", t);
  CHECK(t(2, 1) == init[7] - 1.0f);

  std::vector<float> storage(3);
  auto adapted = xt::adapt(storage, std::vector<std::size_t>{3});
  w.pull("b", adapted);
  CHECK(storage == std::vector<float>(3, 0.5f));

  xt::xarray<float> wrong = xt::zeros<float>({2, 6});
  CHECK_THROWS_AS(w.pull("w", wrong), psx::shape_error);
  xt::xarray<float, xt::layout_type::column_major> cm = xt::zeros<float>({4, 3});
  CHECK(message_of<psx::shape_error>([&] { w.pull("w", cm); }) ==
        "psx: worker 0: pull of variable 'w': an xtensor container of shape [4, 3] and strides [1, 4] cannot be "
        "viewed as row-major parameters: its elements are not contiguous in row-major order");

  // Strided adaptors: every other float of a buffer, in one dimension as in
  // two (a 1-D one was once read and filled as if contiguous).
  std::vector<float> buffer{10, -1, 20, -1, 30};
  auto every_other = xt::adapt(buffer.data(), 3, xt::no_ownership(), std::vector<std::size_t>{3},
                               std::vector<std::ptrdiff_t>{2});
  CHECK(message_of<psx::shape_error>([&] { w.pull("b", every_other); }) ==
        "psx: worker 0: pull of variable 'b': an xtensor container of shape [3] and strides [2] cannot be viewed as "
        "row-major parameters: its elements are not contiguous in row-major order");
  CHECK_THROWS_AS(w.push("b", every_other), psx::shape_error);
  CHECK(buffer == std::vector<float>{10, -1, 20, -1, 30});  // nothing written
  CHECK(ps.read("b") == std::vector<float>(3, 0.5f));       // nothing pushed
  std::vector<float> wide(24, 0.0f);
  auto strided_rows = xt::adapt(wide.data(), 12, xt::no_ownership(), std::vector<std::size_t>{4, 3},
                                std::vector<std::ptrdiff_t>{6, 1});
  CHECK_THROWS_AS(w.pull("w", strided_rows), psx::shape_error);
  // Contiguous ones are taken whatever their declared layout: a column-major
  // vector, explicit row-major strides.
  xt::xarray<float, xt::layout_type::column_major> cm_vector = xt::zeros<float>({3});
  w.pull("b", cm_vector);
  CHECK(cm_vector(1) == 0.5f);
  std::vector<float> dense(12, 0.0f);
  auto explicit_strides = xt::adapt(dense.data(), 12, xt::no_ownership(), std::vector<std::size_t>{4, 3},
                                    std::vector<std::ptrdiff_t>{3, 1});
  w.pull("w", explicit_strides);
  CHECK(dense[7] == t(2, 1));
}
