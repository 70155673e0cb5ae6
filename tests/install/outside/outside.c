/* A program from outside the dbuf tree, in C, built against an installed
 * libdbuf (tests/install): two ranks (this process forks them) attach to the
 * dbufd at SOCKET as job JOB, register a group of two fp32 tensors, all-gather
 * their shards and reduce-scatter gradients, and check every element of both
 * results bitwise. Any error ends it with a message and a non-zero status.
 *
 *   outside_c SOCKET JOB */
#include <dbuf/dbuf.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define WORLD 2
#define TIMEOUT_MS 20000

static unsigned current_rank;
static dbuf_client* current_client;

/* Ends the rank with the call, its status and the library's message unless it succeeded. */
#define CHECK(call)                                                                                   \
  do {                                                                                                \
    dbuf_status status_ = (call);                                                                     \
    if (status_ != DBUF_OK) {                                                                         \
      fprintf(stderr, "outside_c rank %u: %s: %s: %s\n", current_rank, #call, dbuf_status_name(status_), \
              dbuf_last_error(current_client));                                                       \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

static void fail(const char* what) {
  fprintf(stderr, "outside_c rank %u: %s\n", current_rank, what);
  exit(1);
}

/* Values exact in fp32, so that the sum of two is exact whatever the order. */
static float paramValue(size_t tensor, int64_t element) { return (float)(tensor * 1000 + (size_t)element) * 0.5F; }
static float gradValue(unsigned rank, size_t tensor, int64_t element) {
  return (float)((rank + 1) * 10000 + tensor * 100 + (size_t)element) * 0.25F;
}

static int sameBits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static int runRank(const char* socket_path, const char* job, unsigned rank) {
  const char* names[2] = {"w", "b"};
  const uint32_t ndims[2] = {2, 1};
  const int64_t shapes[3] = {6, 4, 5}; /* w: 6 x 4, b: 5 */
  const int64_t numel[2] = {24, 5};
  dbuf_client* client = NULL;
  dbuf_group* group = NULL;
  int64_t checked = 0;
  size_t t;
  int64_t e;

  current_rank = rank;
  current_client = NULL;
  CHECK(dbuf_connect(socket_path, TIMEOUT_MS, &client));
  current_client = client;
  CHECK(dbuf_attach(client, job, rank, WORLD, 0, 1, TIMEOUT_MS));
  CHECK(dbuf_register_group(client, "layer", 2, names, ndims, shapes, "element", "fp32", "fp32", TIMEOUT_MS,
                            &group));

  for (t = 0; t < 2; ++t) {
    dbuf_tensor_view shard;
    CHECK(dbuf_group_view(client, group, t, DBUF_REGION_SHARD, &shard));
    if (strcmp(shard.dtype, "fp32") != 0) fail("the shard is not fp32");
    for (e = shard.begin; e < shard.end; ++e) ((float*)shard.data)[e - shard.begin] = paramValue(t, e);
  }
  /* All-gather: every rank's shard -> the whole tensors in this rank's slot. */
  CHECK(dbuf_group_unshard(client, group, TIMEOUT_MS));
  for (t = 0; t < 2; ++t) {
    dbuf_tensor_view params;
    dbuf_tensor_view grads;
    CHECK(dbuf_group_view(client, group, t, DBUF_REGION_UNSHARDED, &params));
    if (params.begin != 0 || params.end != numel[t]) fail("the unsharded view is not the whole tensor");
    for (e = 0; e < numel[t]; ++e) {
      if (!sameBits(((const float*)params.data)[e], paramValue(t, e))) {
        fprintf(stderr, "outside_c rank %u: all-gather: tensor %zu element %lld is %g, not %g\n", rank, t,
                (long long)e, (double)((const float*)params.data)[e], (double)paramValue(t, e));
        exit(1);
      }
      ++checked;
    }
    CHECK(dbuf_group_view(client, group, t, DBUF_REGION_UNSHARDED_GRAD, &grads));
    for (e = 0; e < numel[t]; ++e) ((float*)grads.data)[e] = gradValue(rank, t, e);
  }
  /* Reduce-scatter (sum): every rank's gradients -> this rank's part of their sum. */
  CHECK(dbuf_run(client, group, DBUF_OP_REDUCE_SCATTER, NULL, 0, TIMEOUT_MS));
  for (t = 0; t < 2; ++t) {
    dbuf_tensor_view sum;
    CHECK(dbuf_group_view(client, group, t, DBUF_REGION_SHARD_GRAD, &sum));
    for (e = sum.begin; e < sum.end; ++e) {
      const float want = gradValue(0, t, e) + gradValue(1, t, e);
      if (!sameBits(((const float*)sum.data)[e - sum.begin], want)) {
        fprintf(stderr, "outside_c rank %u: reduce-scatter: tensor %zu element %lld is %g, not %g\n", rank, t,
                (long long)e, (double)((const float*)sum.data)[e - sum.begin], (double)want);
        exit(1);
      }
      ++checked;
    }
  }
  CHECK(dbuf_group_reshard(client, group, TIMEOUT_MS));
  CHECK(dbuf_run(client, NULL, DBUF_OP_BARRIER, NULL, 0, TIMEOUT_MS));
  dbuf_group_free(group);
  CHECK(dbuf_detach(client, TIMEOUT_MS));
  dbuf_client_free(client);
  printf("outside_c rank %u: ok, %lld elements checked bitwise\n", rank, (long long)checked);
  return 0;
}

int main(int argc, char** argv) {
  pid_t ranks[WORLD];
  int failed = 0;
  unsigned r;
  if (argc != 3) {
    fprintf(stderr, "usage: %s SOCKET JOB\n", argv[0]);
    return 2;
  }
  for (r = 0; r < WORLD; ++r) {
    ranks[r] = fork();
    if (ranks[r] < 0) {
      perror("fork");
      return 1;
    }
    if (ranks[r] == 0) {
      int rc;
      alarm(60); /* a hang fails too */
      rc = runRank(argv[1], argv[2], r);
      fflush(stdout);
      _exit(rc);
    }
  }
  for (r = 0; r < WORLD; ++r) {
    int status = 0;
    if (waitpid(ranks[r], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "outside_c: rank %u failed (wait status %d)\n", r, status);
      failed = 1;
    }
  }
  if (!failed) printf("outside_c: ok\n");
  return failed;
}
