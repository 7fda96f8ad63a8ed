/* verbs-smoke.c: a one-process loopback check of the verbs rdma-rpc relies on,
 * run by scripts/rxe/selftest inside the rxe guest. Two RC QPs are connected
 * to each other, the receiving one on a shared receive queue (SRQ). It checks
 * RDMA WRITE WITH IMMEDIATE (the data lands in the peer's MR, the immediate
 * arrives in the SRQ receive completion) and a plain SEND into the SRQ.
 *
 *   gcc -O2 -o verbs-smoke verbs-smoke.c -libverbs      (on the host)
 *   scripts/rxe/run -- ./verbs-smoke [device [gid_index]]
 *
 * GID index 1 is the IPv4-mapped RoCE v2 GID, 0 the IPv6 link-local one. */
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TOOL "verbs-smoke"
#include "rc-qp.h"

enum { BUF = 4096, IMM = 0xC0FFEE, POLL_SECONDS = 10 };

/* Busy-polls one completion, for at most POLL_SECONDS, and requires success. */
static struct ibv_wc poll1(struct ibv_cq *cq) {
  struct ibv_wc wc;
  struct timespec start, now;
  int n;
  clock_gettime(CLOCK_MONOTONIC, &start);
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    CHECK(now.tv_sec - start.tv_sec < POLL_SECONDS);
  }
  CHECK(n == 1);
  if (wc.status != IBV_WC_SUCCESS) {
    fprintf(stderr, "verbs-smoke: FAIL: completion error: %s\n", ibv_wc_status_str(wc.status));
    exit(1);
  }
  return wc;
}

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : "rxe0";
  int gidx = argc > 2 ? atoi(argv[2]) : 1;
  struct ibv_context *ctx = open_device(name);
  union ibv_gid gid;
  CHECK(!ibv_query_gid(ctx, 1, gidx, &gid));
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  CHECK(pd);
  char *sbuf = calloc(1, BUF), *rbuf = calloc(1, BUF);
  CHECK(sbuf && rbuf);
  struct ibv_mr *smr = ibv_reg_mr(pd, sbuf, BUF, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(smr && rmr);
  struct ibv_cq *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
  struct ibv_cq *rcq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
  CHECK(scq && rcq);
  struct ibv_srq_init_attr sa = {.attr = {.max_wr = 64, .max_sge = 1}};
  struct ibv_srq *srq = ibv_create_srq(pd, &sa);
  CHECK(srq);
  struct ibv_qp_init_attr sender_attr = {
      .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *sender = ibv_create_qp(pd, &sender_attr);
  CHECK(sender);
  struct ibv_qp_init_attr receiver_attr = {
      .send_cq = rcq, .recv_cq = rcq, .srq = srq, .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 16, .max_send_sge = 1}};
  struct ibv_qp *receiver = ibv_create_qp(pd, &receiver_attr);
  CHECK(receiver);
  to_rts(sender, receiver->qp_num, &gid, gidx, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  to_rts(receiver, sender->qp_num, &gid, gidx, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);

  /* Two SRQ receives: one consumed by WRITE_WITH_IMM, one by SEND. */
  for (int i = 0; i < 2; i++) {
    struct ibv_sge s = {.addr = (uintptr_t)rbuf + 2048, .length = 2048, .lkey = rmr->lkey};
    struct ibv_recv_wr w = {.wr_id = 100 + i, .sg_list = &s, .num_sge = 1}, *bad;
    CHECK(!ibv_post_srq_recv(srq, &w, &bad));
  }

  /* 1) RDMA WRITE WITH IMM into rbuf[0..64) */
  strcpy(sbuf, "hello via RDMA_WRITE_WITH_IMM");
  struct ibv_sge s = {.addr = (uintptr_t)sbuf, .length = 64, .lkey = smr->lkey};
  struct ibv_send_wr w = {.wr_id = 1, .sg_list = &s, .num_sge = 1,
                          .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                          .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(IMM)}, *bad;
  w.wr.rdma.remote_addr = (uintptr_t)rbuf;
  w.wr.rdma.rkey = rmr->rkey;
  CHECK(!ibv_post_send(sender, &w, &bad));
  struct ibv_wc wc = poll1(scq);
  CHECK(wc.opcode == IBV_WC_RDMA_WRITE && wc.wr_id == 1);
  wc = poll1(rcq);
  CHECK(wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc.wc_flags & IBV_WC_WITH_IMM));
  CHECK(ntohl(wc.imm_data) == IMM && wc.byte_len == 64 && wc.wr_id == 100);
  CHECK(!strcmp(rbuf, sbuf));
  printf("write_with_imm OK: imm=0x%x byte_len=%u wr_id=%lu data=\"%s\"\n",
         ntohl(wc.imm_data), wc.byte_len, (unsigned long)wc.wr_id, rbuf);

  /* 2) SEND into the second SRQ buffer */
  strcpy(sbuf, "hello via SEND to SRQ");
  memset(rbuf + 2048, 0, 2048);
  w.wr_id = 2;
  w.opcode = IBV_WR_SEND;
  s.length = 32;
  CHECK(!ibv_post_send(sender, &w, &bad));
  wc = poll1(scq);
  CHECK(wc.opcode == IBV_WC_SEND && wc.wr_id == 2);
  wc = poll1(rcq);
  CHECK(wc.opcode == IBV_WC_RECV && wc.byte_len == 32 && wc.wr_id == 101);
  CHECK(!strcmp(rbuf + 2048, sbuf));
  printf("send_to_srq OK: byte_len=%u wr_id=%lu data=\"%s\"\n", wc.byte_len,
         (unsigned long)wc.wr_id, rbuf + 2048);

  CHECK(!ibv_destroy_qp(sender) && !ibv_destroy_qp(receiver) && !ibv_destroy_srq(srq));
  CHECK(!ibv_destroy_cq(scq) && !ibv_destroy_cq(rcq));
  CHECK(!ibv_dereg_mr(smr) && !ibv_dereg_mr(rmr) && !ibv_dealloc_pd(pd));
  CHECK(!ibv_close_device(ctx));
  free(sbuf);
  free(rbuf);
  puts("verbs-smoke: PASS");
  return 0;
}
