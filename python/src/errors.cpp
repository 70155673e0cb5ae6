// dbuf::Error -> the exception classes of dbuf/_errors.py, which keep the
// code, the message and the ranks the error names.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.hpp"

namespace dbuf::python {

void raiseIfPending() {
  if (PyErr_Occurred() != nullptr) throw nb::python_error();
}

void raise(const Error& error) {
  raiseIfPending();
  // Imported per error (errors are not the hot path), so nothing Python is
  // held in a static across interpreter shutdown.
  const nb::object make = nb::module_::import_("dbuf._errors").attr("_from_native");
  const nb::object exception = make(static_cast<int>(error.code), error.message, error.ranks);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
  throw nb::python_error();
}

std::optional<std::chrono::milliseconds> toTimeout(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  if (!(*seconds >= 0.0) || *seconds > 1e9) {  // NaN too
    throw nb::value_error("timeout must be a number of seconds >= 0 (or None for the client's default)");
  }
  // Rounded up, so that a positive timeout never becomes "now".
  const auto ms = static_cast<std::int64_t>(*seconds * 1000.0 + 0.999);
  return std::chrono::milliseconds(ms);
}

std::optional<std::chrono::milliseconds> toRequestTimeout(std::optional<double> seconds) {
  const auto timeout = toTimeout(seconds);
  if (timeout && timeout->count() == 0) {
    throw nb::value_error(
        "timeout must be > 0 seconds for a request to dbufd (a timed-out request closes the "
        "connection)");
  }
  return timeout;
}

void exposeErrors(nb::module_& module) {
  module.def(
      "_error_name", [](int code) { return std::string(toString(static_cast<ErrorCode>(code))); }, nb::arg("code"),
      "libdbuf's name of an ErrorCode value (a check that both sides agree).");
}

}  // namespace dbuf::python
