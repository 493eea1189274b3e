//! Limits on what clients may hold: open connections on the API listener ([`accept`]), the whole request header within a deadline ([`header`]:
//! a connection wrapper pingora lacks), a request's framing and header size ([`framing`]) and
//! open WebSocket connections ([`connections`]: a cap, and the notice to drain on shutdown),
//! and the bytes of bodies and messages held, for the whole process ([`memory`]). The body
//! size and read deadline are enforced where the body is read (`http::body`), the in-flight cap
//! per backend where one is picked (`route`).

pub mod accept;
pub mod connections;
pub mod framing;
pub mod header;
pub mod memory;

pub use accept::{Admitted, OpenConnections};
pub use connections::{ConnectionSlot, Connections};
pub use header::{headers_done, request_done, WithHeaderDeadline};
pub use memory::{Buffered, Held};
