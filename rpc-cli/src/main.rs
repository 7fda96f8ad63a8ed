//! `rpc`: list, describe and call the services of any rdma-rpc server.
//! See `rpc --help`, and the crate's documentation.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = rpc_cli::run(
        &args,
        &mut std::io::stdin(),
        &mut std::io::stdout().lock(),
        &mut std::io::stderr().lock(),
    );
    std::process::exit(code);
}
