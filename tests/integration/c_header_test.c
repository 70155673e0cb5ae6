/* dbuf.h compiled as C89 (-std=c89 -pedantic-errors, see CMakeLists.txt): an
 * outside client written against the C header alone. c_api_test.cpp runs
 * dbuf_c_header_client() against an embedded daemon: one rank attaches with
 * dbuf_attach_ex, registers a group with dbuf_register_group_ex (a tensor
 * with its own granularity, a group alignment), reads the plan, gathers,
 * waits for an op's result and detaches. The client connects with
 * dbuf_connect_ex and an interrupt check that never fires, and keeps a pin
 * of its shard past dbuf_group_free (the view then reads zeros). */
#include <string.h>

#include "dbuf/dbuf.h"

/* 0 on success, else the line of the first check that failed; `why` gets the
 * client's last error then (truncated to why_size). */
int dbuf_c_header_client(const char* socket_path, char* why, size_t why_size);

/* The interrupt check: counts its calls, never fires. */
static int never_interrupted(void* user_data) {
  int* calls = (int*)user_data;
  ++*calls;
  return 0;
}

#define CHECK(condition)      \
  do {                        \
    if (!(condition)) {       \
      failed_line = __LINE__; \
      goto done;              \
    }                         \
  } while (0)

int dbuf_c_header_client(const char* socket_path, char* why, size_t why_size) {
  int failed_line = 0;
  dbuf_client* client = NULL;
  dbuf_group* group = NULL;
  dbuf_attach_options attach;
  dbuf_tensor_spec tensors[2];
  dbuf_group_options options;
  dbuf_op_result result;
  static const int64_t kWeightShape[2] = {12, 8};
  static const int64_t kBiasShape[1] = {5};
  const char* text = NULL;
  const int64_t* dims = NULL;
  uint32_t ndim = 0;
  uint32_t value = 0;
  int64_t granularity = 0;
  int flag = -1;
  dbuf_op op = 0;
  dbuf_connect_options connect;
  int interrupt_calls = 0;
  int32_t device = 99;
  dbuf_pin* pin = NULL;
  dbuf_tensor_view view;
  const float* shard = NULL;
  int64_t e = 0;

  CHECK(strcmp(dbuf_status_name(DBUF_CANCELLED), "DBUF_CANCELLED") == 0);
  CHECK(dbuf_attach_options_init(&attach, sizeof attach) == DBUF_OK);
  CHECK(attach.struct_size == sizeof attach && attach.world_size == 1 && attach.device == -1);
  CHECK(dbuf_connect_options_init(&connect, sizeof connect) == DBUF_OK);
  CHECK(connect.timeout_ms == 10000 && connect.interrupted == NULL && connect.interrupt_data == NULL);
  connect.socket_path = socket_path;
  connect.interrupted = never_interrupted;
  connect.interrupt_data = &interrupt_calls;
  CHECK(dbuf_connect_ex(&connect, &client) == DBUF_OK);
  attach.job = "c-header";
  attach.prefetch_depth = 2;
  CHECK(dbuf_attach_ex(client, &attach, 10000) == DBUF_OK);

  CHECK(dbuf_tensor_spec_init(&tensors[0], sizeof tensors[0]) == DBUF_OK);
  CHECK(dbuf_tensor_spec_init(&tensors[1], sizeof tensors[1]) == DBUF_OK);
  tensors[0].name = "w";
  tensors[0].shape = kWeightShape;
  tensors[0].ndim = 2;
  tensors[0].granularity = "rows:3";
  tensors[1].name = "b";
  tensors[1].shape = kBiasShape;
  tensors[1].ndim = 1;
  CHECK(dbuf_group_options_init(&options, sizeof options) == DBUF_OK);
  options.sharded_dtype = "fp32";
  options.unsharded_dtype = "fp32";
  options.align_bytes = 64;
  CHECK(dbuf_register_group_ex(client, "c-layer", 2, tensors, &options, 10000, &group) == DBUF_OK);

  CHECK(dbuf_group_name(group, &text) == DBUF_OK && strcmp(text, "c-layer") == 0);
  CHECK(dbuf_group_devices(group, &value) == DBUF_OK && value == 1);
  CHECK(dbuf_group_rank(group, &value) == DBUF_OK && value == 0);
  CHECK(dbuf_group_tensor_name(group, 1, &text) == DBUF_OK && strcmp(text, "b") == 0);
  CHECK(dbuf_group_tensor_shape(group, 0, &dims, &ndim) == DBUF_OK && ndim == 2 && dims[0] == 12 && dims[1] == 8);
  CHECK(dbuf_group_tensor_granularity(group, 0, &granularity) == DBUF_OK && granularity == 3 * 8);
  /* 64-byte alignment of fp32 elements: offsets are multiples of 16. */
  CHECK(dbuf_group_tensor_offset(group, 1) % 16 == 0 && dbuf_group_tensor_offset(group, 1) >= 12 * 8);
  CHECK(dbuf_group_tensor_name(group, 2, &text) == DBUF_INVALID_ARGUMENT);
  CHECK(strstr(dbuf_last_error(client), "tensor 2") != NULL);

  CHECK(dbuf_group_is_unsharded(group, &flag) == DBUF_OK && flag == 0);
  CHECK(dbuf_group_acquire_slot(client, group, 10000) == DBUF_OK);
  CHECK(dbuf_group_is_unsharded(group, &flag) == DBUF_OK && flag == 1);
  CHECK(dbuf_op_result_init(&result, sizeof result) == DBUF_OK);
  CHECK(dbuf_submit(client, group, DBUF_OP_ALL_GATHER, NULL, 0, 1, 10000, &op) == DBUF_OK);
  CHECK(dbuf_in_flight(client, &value) == DBUF_OK && value <= 1);
  CHECK(dbuf_wait_result(client, op, 10000, &result) == DBUF_OK);
  CHECK(result.struct_size == sizeof result && result.run_ns >= 0 && result.wait_ns >= 0);
  CHECK(dbuf_in_flight(client, &value) == DBUF_OK && value == 0);
  CHECK(dbuf_group_reshard(client, group, 10000) == DBUF_OK);
  CHECK(dbuf_reattached(client, &flag) == DBUF_OK && flag == 0);
  CHECK(dbuf_memory_device(client, &device) == DBUF_OK && device == -1);

  /* A pin keeps the shard's range past the group: zeros there. */
  CHECK(dbuf_group_view(client, group, 0, DBUF_REGION_SHARD, &view) == DBUF_OK && view.data != NULL);
  for (e = view.begin; e < view.end; ++e) ((float*)view.data)[e - view.begin] = 1.0F + (float)e;
  shard = (const float*)view.data;
  CHECK(shard[0] == 1.0F + (float)view.begin);
  CHECK(dbuf_group_pin(client, group, DBUF_REGION_SHARD, &pin) == DBUF_OK && pin != NULL);
  dbuf_group_free(group);
  group = NULL;
  for (e = view.begin; e < view.end; ++e) CHECK(shard[e - view.begin] == 0.0F);
  dbuf_pin_free(pin);
  pin = NULL;

done:
  if (failed_line != 0 && why != NULL && why_size > 0) {
    strncpy(why, dbuf_last_error(client), why_size - 1);
    why[why_size - 1] = '\0';
  }
  dbuf_pin_free(pin);
  dbuf_group_free(group);
  if (client != NULL && failed_line == 0 && dbuf_detach(client, 10000) != DBUF_OK) failed_line = __LINE__;
  dbuf_client_free(client);
  return failed_line;
}
