// dbuf.TensorView: a view of daemon memory, handed to NumPy, PyTorch or any
// DLPack consumer without a copy. The arrays own a pin of the view's address
// range (dbuf::TensorView::pin), so they never point at unmapped memory.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace dbuf::python {
namespace {

using namespace nb::literals;
namespace dl = nb::dlpack;

/// DLPack's type of `dtype`; with `bits`, an unsigned integer of its width
/// (NumPy has no bfloat16 or fp8).
dl::dtype dlpackType(DType dtype, bool bits) {
  const auto width = static_cast<std::uint8_t>(8 * sizeBytes(dtype));
  if (bits) return {static_cast<std::uint8_t>(dl::dtype_code::UInt), width, 1};
  switch (dtype) {
    case DType::kF32:
    case DType::kF16:
    case DType::kF64:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float), width, 1};
    case DType::kBF16:
      return {static_cast<std::uint8_t>(dl::dtype_code::Bfloat), width, 1};
    case DType::kF8E4M3:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float8_E4M3FN), width, 1};
    case DType::kF8E5M2:
      return {static_cast<std::uint8_t>(dl::dtype_code::Float8_E5M2), width, 1};
    case DType::kI8:
    case DType::kI32:
    case DType::kI64:
      return {static_cast<std::uint8_t>(dl::dtype_code::Int), width, 1};
    case DType::kU8:
      return {static_cast<std::uint8_t>(dl::dtype_code::UInt), width, 1};
  }
  return {static_cast<std::uint8_t>(dl::dtype_code::UInt), width, 1};
}

/// What an empty view points at (DLPack consumers want a non-null address).
alignas(64) std::byte empty_view_storage[64];  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables)

/// The view as an ndarray of framework `Framework`, owning a pin.
template <typename Framework>
nb::ndarray<Framework> toArray(const PyTensorView& v, bool bits) {
  std::vector<std::size_t> shape;
  if (v.whole) {
    for (const std::int64_t dim : v.view.shape) shape.push_back(static_cast<std::size_t>(dim));
  } else {
    shape.push_back(static_cast<std::size_t>(v.view.numel()));
  }
  void* data = v.view.base != nullptr ? static_cast<void*>(v.view.base) : static_cast<void*>(empty_view_storage);
  auto* pin = new std::shared_ptr<const void>(v.view.pin);  // NOLINT(cppcoreguidelines-owning-memory)
  const nb::capsule owner(pin, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<const void>*>(p);  // NOLINT(cppcoreguidelines-owning-memory)
  });
  const int device_type =
      v.device ? static_cast<int>(nb::device::cuda::value) : static_cast<int>(nb::device::cpu::value);
  return nb::ndarray<Framework>(data, shape.size(), shape.data(), owner, nullptr, dlpackType(v.view.dtype, bits),
                                device_type, v.device.value_or(0));
}

std::vector<std::int64_t> viewShape(const PyTensorView& v) {
  if (v.whole) return v.view.shape;
  return {v.view.numel()};
}

}  // namespace

void exposeViews(nb::module_& m) {
  nb::class_<PyTensorView>(m, "TensorView",
                           "A view of dbufd's memory: a tensor's part in the sharded region (1-D) or the whole "
                           "tensor in the unsharded slot. numpy() and torch() give zero-copy arrays over it (the "
                           "DLPack protocol too); they keep the memory mapped for as long as they live.")
      .def_prop_ro("name", [](const PyTensorView& v) { return v.view.name; })
      .def_prop_ro(
          "dtype", [](const PyTensorView& v) { return std::string(toString(v.view.dtype)); },
          "'fp32', 'bf16', 'fp16' or 'fp8_e4m3'")
      .def_prop_ro(
          "tensor_shape", [](const PyTensorView& v) { return v.view.shape; }, "the whole tensor's shape")
      .def_prop_ro("shape", &viewShape, "the view's shape: the tensor's when whole, else (numel,)")
      .def_prop_ro(
          "begin", [](const PyTensorView& v) { return v.view.begin; },
          "first element (of the flattened tensor) in the view")
      .def_prop_ro(
          "end", [](const PyTensorView& v) { return v.view.end; }, "one past the last")
      .def_prop_ro("numel", [](const PyTensorView& v) { return v.view.numel(); })
      .def_prop_ro(
          "local_units", [](const PyTensorView& v) { return v.view.local_units; }, "RaggedShard blocks in the view")
      .def_prop_ro(
          "device", [](const PyTensorView& v) { return v.device; }, "None: host memory; else the GPU")
      .def_prop_ro("data_ptr", [](const PyTensorView& v) { return reinterpret_cast<std::uintptr_t>(v.view.base); })
      .def(
          "numpy",
          [](const PyTensorView& v, bool bits) {
            if (v.device) throw nb::type_error("a view of GPU memory has no NumPy array: use torch()");
            const bool has_numpy_type = v.view.dtype == DType::kF32 || v.view.dtype == DType::kF16;
            if (!bits && !has_numpy_type) {
              throw nb::type_error(("NumPy has no " + std::string(toString(v.view.dtype)) +
                                    ": use torch(), or numpy(bits=True) for the raw bits as unsigned integers")
                                       .c_str());
            }
            return toArray<nb::numpy>(v, bits);
          },
          "bits"_a = false,
          "A NumPy array over the view (no copy). bits=True: unsigned integers of the element's width "
          "(for bf16 / fp8).")
      .def(
          "torch", [](const PyTensorView& v) { return toArray<nb::pytorch>(v, false); },
          "A torch.Tensor over the view (no copy), on the CPU or on the session's GPU.")
      .def(
          "__dlpack__",
          [](const PyTensorView& v, const nb::kwargs& kwargs) {
            return nb::cast(toArray<nb::array_api>(v, false)).attr("__dlpack__")(**kwargs);
          },
          "kwargs"_a)
      .def("__dlpack_device__",
           [](const PyTensorView& v) {
             return nb::make_tuple(
                 v.device ? static_cast<int>(nb::device::cuda::value) : static_cast<int>(nb::device::cpu::value),
                 v.device.value_or(0));
           })
      .def("__repr__", [](const PyTensorView& v) {
        return "TensorView('" + v.view.name + "', " + std::string(toString(v.view.dtype)) + ", elements [" +
               std::to_string(v.view.begin) + ", " + std::to_string(v.view.end) + ")" +
               (v.device ? ", cuda:" + std::to_string(*v.device) : std::string()) + ")";
      });
}

}  // namespace dbuf::python
