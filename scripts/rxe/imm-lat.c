/* imm-lat.c: the floor of rdma-rpc's verbs pattern at one message in flight,
 * with no RPC software around it, beside ib_write_lat's pattern, in one
 * process and one boot of the rxe guest.
 *
 * Two threads ping-pong 64-byte messages over two RC QPs of one device, each
 * thread busy-polling, as ib_write_lat's two processes do:
 *
 *   write  RDMA WRITE into the peer's buffer; the peer polls the buffer's
 *          last byte (ib_write_lat's pattern).
 *   imm    RDMA WRITE WITH IMMEDIATE into the peer's buffer; the peer polls
 *          its receive CQ, fed by a shared receive queue (SRQ) from which
 *          each message takes a zero-length receive, put back as soon as
 *          its completion is polled (rdma-rpc's doorbell, and what its
 *          verbs completion queue does).
 *
 * Sends are inline, as rdma-rpc posts small ones, and signaled one in 16
 * (their completions reaped on the way). The two patterns alternate, in
 * turn first. Prints, per pattern, the round trip's median and the
 * one-way figure ib_write_lat prints (half of it):
 *
 *   gcc -O2 -Wall -pthread -o imm-lat imm-lat.c -libverbs
 *   scripts/rxe/run -- ./imm-lat [rounds [iterations [device [gid_index]]]]
 */
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TOOL "imm-lat"
#include "rc-qp.h"

enum { SIZE = 64, BUF = 4096, DEPTH = 64, SIGNAL_EVERY = 16, WARMUP = 1000 };

struct side {
  struct ibv_cq *scq, *rcq;
  struct ibv_srq *srq;
  struct ibv_qp *qp;
  struct ibv_mr *smr, *rmr;
  volatile char *rbuf;
  char *sbuf;
  uint64_t posted;
  /* The peer's receive buffer. */
  uint64_t raddr;
  uint32_t rkey;
};

static int imm_mode;
static long iterations;

static void post_recv(struct side *s) {
  struct ibv_recv_wr w = {.wr_id = 7, .sg_list = NULL, .num_sge = 0}, *bad;
  CHECK(!ibv_post_srq_recv(s->srq, &w, &bad));
}

/* Sends message number `seq` to the peer. Its last byte is never 0, and
 * the waiter sets it back to 0 once seen, before it replies: the peer's
 * next message can only come after that reply. */
static void send_one(struct side *s, uint64_t seq) {
  s->sbuf[SIZE - 1] = (char)(seq | 1);
  struct ibv_sge sge = {.addr = (uintptr_t)s->sbuf, .length = SIZE, .lkey = s->smr->lkey};
  struct ibv_send_wr w = {.wr_id = seq, .sg_list = &sge, .num_sge = 1}, *bad;
  w.opcode = imm_mode ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  w.imm_data = htonl((uint32_t)seq);
  w.send_flags = IBV_SEND_INLINE;
  if (++s->posted % SIGNAL_EVERY == 0) w.send_flags |= IBV_SEND_SIGNALED;
  w.wr.rdma.remote_addr = s->raddr;
  w.wr.rdma.rkey = s->rkey;
  CHECK(!ibv_post_send(s->qp, &w, &bad));
  struct ibv_wc wc;
  int n = ibv_poll_cq(s->scq, 1, &wc);
  CHECK(n >= 0 && (n == 0 || wc.status == IBV_WC_SUCCESS));
}

/* Waits for message number `seq` from the peer. */
static void wait_one(struct side *s, uint64_t seq) {
  if (imm_mode) {
    struct ibv_wc wc;
    int n;
    while ((n = ibv_poll_cq(s->rcq, 1, &wc)) == 0) {
    }
    CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
    CHECK(ntohl(wc.imm_data) == (uint32_t)seq);
    post_recv(s);
  } else {
    while (s->rbuf[SIZE - 1] != (char)(seq | 1)) {
    }
    s->rbuf[SIZE - 1] = 0;
  }
}

static struct side a, b;

static void *server(void *arg) {
  (void)arg;
  for (long i = 0; i < WARMUP + iterations; i++) {
    wait_one(&b, (uint64_t)i);
    send_one(&b, (uint64_t)i);
  }
  return NULL;
}

static int cmp(const void *x, const void *y) {
  double d = *(const double *)x - *(const double *)y;
  return (d > 0) - (d < 0);
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void setup(struct side *s, struct ibv_context *ctx, struct ibv_pd *pd) {
  s->sbuf = calloc(1, BUF);
  s->rbuf = calloc(1, BUF);
  CHECK(s->sbuf && s->rbuf);
  s->smr = ibv_reg_mr(pd, s->sbuf, BUF, IBV_ACCESS_LOCAL_WRITE);
  s->rmr = ibv_reg_mr(pd, (void *)s->rbuf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(s->smr && s->rmr);
  s->scq = ibv_create_cq(ctx, DEPTH, NULL, NULL, 0);
  s->rcq = ibv_create_cq(ctx, DEPTH, NULL, NULL, 0);
  CHECK(s->scq && s->rcq);
  struct ibv_srq_init_attr sa = {.attr = {.max_wr = DEPTH, .max_sge = 1}};
  s->srq = ibv_create_srq(pd, &sa);
  CHECK(s->srq);
  struct ibv_qp_init_attr qa = {
      .send_cq = s->scq, .recv_cq = s->rcq, .srq = s->srq, .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = DEPTH, .max_send_sge = 1, .max_inline_data = SIZE}};
  s->qp = ibv_create_qp(pd, &qa);
  CHECK(s->qp);
  for (int i = 0; i < DEPTH / 2; i++) post_recv(s);
}

static void teardown(struct side *s) {
  CHECK(!ibv_destroy_qp(s->qp) && !ibv_destroy_srq(s->srq));
  CHECK(!ibv_destroy_cq(s->scq) && !ibv_destroy_cq(s->rcq));
  CHECK(!ibv_dereg_mr(s->smr) && !ibv_dereg_mr(s->rmr));
  free(s->sbuf);
  free((void *)s->rbuf);
}

/* One run of one pattern: the median round trip, in µs. */
static double run(struct ibv_context *ctx, struct ibv_pd *pd, const union ibv_gid *gid, int gidx) {
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  setup(&a, ctx, pd);
  setup(&b, ctx, pd);
  to_rts(a.qp, b.qp->qp_num, gid, gidx, IBV_ACCESS_REMOTE_WRITE);
  to_rts(b.qp, a.qp->qp_num, gid, gidx, IBV_ACCESS_REMOTE_WRITE);
  a.raddr = (uintptr_t)b.rbuf;
  a.rkey = b.rmr->rkey;
  b.raddr = (uintptr_t)a.rbuf;
  b.rkey = a.rmr->rkey;
  double *rtt = malloc(sizeof(double) * (size_t)iterations);
  CHECK(rtt);
  pthread_t t;
  CHECK(!pthread_create(&t, NULL, server, NULL));
  for (long i = 0; i < WARMUP + iterations; i++) {
    double t0 = now_us();
    send_one(&a, (uint64_t)i);
    wait_one(&a, (uint64_t)i);
    if (i >= WARMUP) rtt[i - WARMUP] = now_us() - t0;
  }
  CHECK(!pthread_join(t, NULL));
  qsort(rtt, (size_t)iterations, sizeof(double), cmp);
  double p50 = rtt[iterations / 2];
  free(rtt);
  teardown(&a);
  teardown(&b);
  return p50;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 3;
  iterations = argc > 2 ? atol(argv[2]) : 10000;
  const char *name = argc > 3 ? argv[3] : "rxe0";
  int gidx = argc > 4 ? atoi(argv[4]) : 1;
  CHECK(rounds > 0 && iterations > 0);
  struct ibv_context *ctx = open_device(name);
  union ibv_gid gid;
  CHECK(!ibv_query_gid(ctx, 1, gidx, &gid));
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  CHECK(pd);
  for (int r = 1; r <= rounds; r++) {
    for (int k = 0; k <= 1; k++) {
      imm_mode = (r + k) % 2;
      double p50 = run(ctx, pd, &gid, gidx);
      printf("round=%d pattern=%s size=%d iterations=%ld rtt_p50_us=%.2f one_way_us=%.2f\n", r,
             imm_mode ? "imm" : "write", SIZE, iterations, p50, p50 / 2);
      fflush(stdout);
    }
  }
  CHECK(!ibv_dealloc_pd(pd) && !ibv_close_device(ctx));
  return 0;
}
