//! The README demo (orders → outbox → outboxd → broker → shipping inbox) runs to the end, so it
//! cannot rot: 5 effects applied exactly once, and a full replay applies none.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_demo_runs_end_to_end() -> anyhow::Result<()> {
    outboxd_demo::run(&outboxd_tests::relay_bin()).await
}
