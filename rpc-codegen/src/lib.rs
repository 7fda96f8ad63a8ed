//! rdma-rpc code generator (in progress).
