//! The listener: one connection of the backend's own, `LISTEN`ing on the release channel.
//! tokio-postgres hands notifications only to whoever polls the connection itself
//! (`Connection::poll_message`; its `Future` drops them), so a pooled connection never sees
//! them. When the connection breaks it is opened again (with a growing pause, at most a
//! second); notifications sent meanwhile are lost, so every local waiter is woken and the
//! backend reports a disturbance.

use std::sync::Arc;
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::future::{self, Either};
use futures::StreamExt;
use tokio_postgres::{AsyncMessage, NoTls};

use super::Hub;

/// Runs until `stop` resolves (the backend was dropped).
pub(super) async fn run(
    mut config: tokio_postgres::Config,
    listen: String,
    hub: Arc<Hub>,
    mut stop: oneshot::Receiver<()>,
) {
    // A listener that hears nothing cannot tell a quiet channel from a dead peer: TCP
    // keep-alives find the dead one.
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(5))
        .keepalives_interval(Duration::from_secs(1))
        .keepalives_retries(3);
    let mut pause = Duration::from_millis(10);
    loop {
        let session = std::pin::pin!(session(&config, &listen, &hub));
        match future::select(session, &mut stop).await {
            Either::Left((true, _)) => pause = Duration::from_millis(10),
            Either::Left((false, _)) => {}
            Either::Right(_) => return,
        }
        // Broken (or never opened): not subscribed; whatever was notified meanwhile is lost.
        hub.ready.send_replace(false);
        hub.wake_all();
        let sleep = std::pin::pin!(crate::runtime::sleep(pause));
        if let Either::Right(_) = future::select(sleep, &mut stop).await {
            return;
        }
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// One connection's life: connect, `LISTEN`, then hand each notification's key to the hub
/// until the connection ends. Whether it subscribed.
async fn session(config: &tokio_postgres::Config, listen: &str, hub: &Arc<Hub>) -> bool {
    // Bounded as a whole: a paused server accepts the socket and never answers.
    let limit = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_secs(5));
    let Ok(Ok((client, mut connection))) = tokio::time::timeout(limit, config.connect(NoTls)).await
    else {
        return false;
    };
    let (tx, mut rx) = mpsc::unbounded::<String>();
    crate::runtime::background().spawn(async move {
        while let Some(message) = future::poll_fn(|cx| connection.poll_message(cx)).await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    if tx.unbounded_send(n.payload().to_owned()).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    match tokio::time::timeout(limit, client.batch_execute(listen)).await {
        Ok(Ok(())) => {}
        _ => return false,
    }
    // Subscribed: releases from now on are heard. Waiters that subscribed before the break
    // look again (their notification may have been lost).
    let was = hub.ready.send_replace(true);
    if !was {
        hub.wake_all();
    }
    while let Some(key) = rx.next().await {
        hub.wake(&key);
    }
    drop(client);
    true
}
