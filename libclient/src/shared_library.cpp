// libdbuf.so (the target dbuf_client_shared) is the archives of dbuf_client
// and dbuf_planner linked whole (libclient/CMakeLists.txt); CMake wants a
// source of its own for a library target, and this is it. Nothing here.
