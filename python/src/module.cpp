// dbuf._dbuf: the native core of the `dbuf` package (see bindings.hpp).
#include "bindings.hpp"

NB_MODULE(_dbuf, m) {
  m.doc() =
      "Native core of dbuf: libdbuf's client (Client, Group, Op, TensorView) and the RaggedShard planner. "
      "Import `dbuf` rather than this module.";
  dbuf::python::exposeErrors(m);
  dbuf::python::exposeSession(m);
  dbuf::python::exposeViews(m);
  dbuf::python::exposePlanner(m);
  m.attr("cuda") = DBUF_PYTHON_CUDA;
  // Units, groups and views often live in module-level objects (a model, an
  // optimizer) until the interpreter exits, after nanobind has started to
  // tear its types down: not leaks.
  nanobind::set_leak_warnings(false);
}
