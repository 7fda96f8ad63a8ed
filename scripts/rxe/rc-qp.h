/* rc-qp.h: what the guest's C tools (verbs-smoke.c, imm-lat.c) share:
 * CHECK, opening a device by name, and bringing an RC queue pair to RTS
 * against a peer on the same device. The includer defines TOOL, its name
 * as failures print it. */
#ifndef RC_QP_H
#define RC_QP_H

#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Reports `x` (with errno) and the line, and exits, if `x` is false. */
#define CHECK(x)                                                 \
  do {                                                           \
    if (!(x)) {                                                  \
      perror(#x);                                                \
      fprintf(stderr, TOOL ": FAIL at line %d\n", __LINE__);     \
      exit(1);                                                   \
    }                                                            \
  } while (0)

/* Opens the device called `name`. */
static struct ibv_context *open_device(const char *name) {
  int n;
  struct ibv_device **list = ibv_get_device_list(&n), *dev = NULL;
  CHECK(list);
  for (int i = 0; i < n; i++)
    if (!strcmp(ibv_get_device_name(list[i]), name)) dev = list[i];
  CHECK(dev);
  struct ibv_context *ctx = ibv_open_device(dev);
  CHECK(ctx);
  /* An open device outlives the list it was found in. */
  ibv_free_device_list(list);
  return ctx;
}

/* INIT (with `access` for the peer), RTR towards QP `dqpn` at `gid`
 * (GID index `gidx` on port 1), then RTS; PSNs start at 0. */
static void to_rts(struct ibv_qp *qp, uint32_t dqpn, const union ibv_gid *gid, int gidx,
                   int access) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
                          .qp_access_flags = access};
  CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dqpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = *gid;
  a.ah_attr.grh.sgid_index = gidx;
  a.ah_attr.grh.hop_limit = 64;
  a.ah_attr.port_num = 1;
  CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC));
}

#endif
