/* Replays commlayer allreduce schedules in SimGrid SMPI (built with smpicc, run by smpirun).
 *
 * Usage: replay TRACE_DIR          every rank replays TRACE_DIR/rank<N>.trace
 *        replay --builtin BYTES    MPI_Allreduce of BYTES (floats, an operation computing
 *                                  nothing, see no_op): SMPI's own algorithm,
 *                                  picked with --cfg=smpi/allreduce:NAME
 *
 * A trace (written by commlayer/sim/export.py) is text:
 *   commlayer-sim-trace 1
 *   STEPS
 *   NSEND NRECV COMPUTE_S PEER BYTES ... (NSEND sends, then NRECV receives)   one line per step
 * A step posts all its sends and receives at once and waits for all of them (the executor's
 * step: transfers of one step overlap, steps follow each other), then spends COMPUTE_S seconds
 * of simulated computation (the reduction or copy of what it received; 0 when not costed).
 * No payload is computed: every buffer is one SMPI_SHARED_MALLOC block that all ranks share,
 * which SMPI does not copy either. The k-th message from a to b matches the k-th receive of b
 * from a (one tag, MPI's non-overtaking order), as in the executor.
 *
 * Rank 0 prints "commlayer-sim simulated_s=T", T from the earliest start to the latest end
 * over the ranks. No barrier before the start: every rank starts at simulated time 0 (reading
 * the trace costs no simulated time with smpi/simulate-computation:no), where a barrier would
 * release the ranks one latency apart and add that skew (1 us on flat) to every time.
 */
#include <limits.h>
#include <mpi.h>
#include <simgrid/host.h>
#include <smpi/smpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int nsend, nrecv;
  double compute_s;
  long long *peer_bytes; /* (peer, bytes) pairs: sends first, then receives */
} step_t;

static void fail(const char *what, const char *path) {
  fprintf(stderr, "commlayer-sim replay: %s: %s\n", what, path);
  MPI_Abort(MPI_COMM_WORLD, 2);
}

/* Reads a whole trace; returns the step count, *max_bytes the largest transfer. */
static int read_trace(const char *path, step_t **out, long long *max_bytes, int *max_transfers) {
  FILE *f = fopen(path, "r");
  if (!f) fail("cannot open", path);
  int version = 0, steps = 0;
  if (fscanf(f, "commlayer-sim-trace %d %d", &version, &steps) != 2 || version != 1)
    fail("not a version-1 trace", path);
  step_t *s = calloc(steps > 0 ? steps : 1, sizeof(step_t));
  for (int i = 0; i < steps; i++) {
    if (fscanf(f, "%d %d %lf", &s[i].nsend, &s[i].nrecv, &s[i].compute_s) != 3) fail("truncated", path);
    int n = s[i].nsend + s[i].nrecv;
    if (n > *max_transfers) *max_transfers = n;
    s[i].peer_bytes = malloc(2 * (size_t)n * sizeof(long long));
    for (int j = 0; j < 2 * n; j++)
      if (fscanf(f, "%lld", &s[i].peer_bytes[j]) != 1) fail("truncated", path);
    for (int j = 0; j < n; j++)
      if (s[i].peer_bytes[2 * j + 1] > *max_bytes) *max_bytes = s[i].peer_bytes[2 * j + 1];
  }
  fclose(f);
  *out = s;
  return steps;
}

/* A message over INT_MAX bytes (an allgather's last steps at 1024 ranks) travels as MiB units,
 * rounded up (under 1 MiB in 2 GiB: < 0.05%); both ends compute the same count and type. */
static MPI_Datatype mib = MPI_DATATYPE_NULL;

static int count_of(long long bytes) {
  return bytes > INT_MAX ? (int)((bytes + (1 << 20) - 1) >> 20) : (int)bytes;
}

static MPI_Datatype type_of(long long bytes) {
  if (bytes <= INT_MAX) return MPI_BYTE;
  if (mib == MPI_DATATYPE_NULL) {
    MPI_Type_contiguous(1 << 20, MPI_BYTE, &mib);
    MPI_Type_commit(&mib);
  }
  return mib;
}

static double replay(const char *dir, int rank) {
  char path[4096];
  snprintf(path, sizeof path, "%s/rank%d.trace", dir, rank);
  step_t *steps = NULL;
  long long max_bytes = 1;
  int max_transfers = 1;
  int count = read_trace(path, &steps, &max_bytes, &max_transfers);
  /* one shared block: every rank gets the same memory, nothing is copied */
  char *buf = SMPI_SHARED_MALLOC((size_t)max_bytes + (1 << 20)); /* + the MiB rounding */
  MPI_Request *requests = malloc((size_t)max_transfers * sizeof(MPI_Request));
  double speed = sg_host_get_speed(sg_host_self());
  double start = MPI_Wtime();
  for (int i = 0; i < count; i++) {
    step_t *s = &steps[i];
    int n = 0;
    for (int j = 0; j < s->nrecv; j++) {
      long long *t = &s->peer_bytes[2 * (s->nsend + j)];
      MPI_Irecv(buf, count_of(t[1]), type_of(t[1]), (int)t[0], 0, MPI_COMM_WORLD, &requests[n++]);
    }
    for (int j = 0; j < s->nsend; j++) {
      long long *t = &s->peer_bytes[2 * j];
      MPI_Isend(buf, count_of(t[1]), type_of(t[1]), (int)t[0], 0, MPI_COMM_WORLD, &requests[n++]);
    }
    MPI_Waitall(n, requests, MPI_STATUSES_IGNORE);
    if (s->compute_s > 0) smpi_execute_flops(s->compute_s * speed);
  }
  double end = MPI_Wtime();
  SMPI_SHARED_FREE(buf);
  free(requests);
  for (int i = 0; i < count; i++) free(steps[i].peer_bytes);
  free(steps);
  double first = 0, last = 0;
  MPI_Reduce(&start, &first, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
  MPI_Reduce(&end, &last, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  return last - first;
}

/* A commutative operation that computes nothing: SMPI's collectives apply the operation on this
 * machine's CPU (simulate-computation:no only keeps that time out of the simulated clock), and
 * MPI_SUM over 64 MiB at 1024 ranks is 64 GiB of additions. */
static void no_op(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)in, (void)inout, (void)len, (void)type;
}

static double builtin(long long nbytes) {
  int count = (int)(nbytes / 4);
  float *send = SMPI_SHARED_MALLOC((size_t)count * 4);
  float *recv = SMPI_SHARED_MALLOC((size_t)count * 4);
  MPI_Op op;
  MPI_Op_create(no_op, 1, &op);
  double start = MPI_Wtime();
  MPI_Allreduce(send, recv, count, MPI_FLOAT, op, MPI_COMM_WORLD);
  double end = MPI_Wtime();
  MPI_Op_free(&op);
  SMPI_SHARED_FREE(send);
  SMPI_SHARED_FREE(recv);
  double first = 0, last = 0;
  MPI_Reduce(&start, &first, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
  MPI_Reduce(&end, &last, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  return last - first;
}

int main(int argc, char *argv[]) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  double seconds;
  if (argc == 3 && strcmp(argv[1], "--builtin") == 0)
    seconds = builtin(atoll(argv[2]));
  else if (argc == 2)
    seconds = replay(argv[1], rank);
  else {
    if (rank == 0) fprintf(stderr, "usage: replay TRACE_DIR | replay --builtin BYTES\n");
    MPI_Finalize();
    return 2;
  }
  if (rank == 0) printf("commlayer-sim simulated_s=%.12e\n", seconds);
  MPI_Finalize();
  return 0;
}
