//! `outboxd-demo <path to outboxd>`: see the library docs; `scripts/demo.sh` runs it.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let bin = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: outboxd-demo <path to the outboxd binary>"))?;
    outboxd_demo::run(std::path::Path::new(&bin)).await
}
