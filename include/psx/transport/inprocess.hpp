//! @file psx/transport/inprocess.hpp
//! Servers and workers as threads of one process. A request is handed to the
//! server's inbox as it is: its spans point at the worker's own buffers, so
//! no byte is serialized or copied on the way.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/queue.hpp>
#include <psx/errors.hpp>

#include <cstddef>
#include <exception>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {
namespace transport {

//! The in-process transport (the default).
struct InProcess {
  //! One inbox per server; `serve` pops from it.
  class link_type {
   public:
    explicit link_type(std::size_t num_servers) : inboxes_(num_servers) {}

    void send(std::size_t server, Request&& r) {
      if (server >= inboxes_.size())
        throw config_error("psx: request for server " + std::to_string(server) + " of " +
                           std::to_string(inboxes_.size()));
      if (!inboxes_[server].push(std::move(r)))
        throw shutdown_error("psx: server " + std::to_string(server) + " is shut down");
    }

    void serve(std::size_t server, RequestHandler& handler) {
      auto& inbox = inboxes_.at(server);
      for (;;) {
        auto r = inbox.pop_until(handler.next_tick());
        if (r) {
          handler.handle(std::move(*r));
        } else if (inbox.closed()) {
          break;
        }
        const auto now = RequestHandler::clock_type::now();
        if (now >= handler.next_tick()) handler.tick(now);
      }
      const std::string why = "psx: server " + std::to_string(server) + " shut down before answering";
      const RequestHandler::ErrorFactory make_error = [&] { return std::make_exception_ptr(shutdown_error(why)); };
      for (Request& left : inbox.take_all()) left.finish(make_error());
      handler.drain(make_error);
    }

    void close() noexcept {
      for (auto& inbox : inboxes_) inbox.close();
    }

   private:
    std::vector<detail::ClosableQueue<Request>> inboxes_;
  };

  std::unique_ptr<link_type> connect(const TransportContext& ctx) const {
    return std::make_unique<link_type>(ctx.num_servers);
  }
  friend bool operator==(const InProcess&, const InProcess&) = default;
  friend std::ostream& operator<<(std::ostream& os, const InProcess&) { return os << "InProcess"; }
};
static_assert(Transport<InProcess>);

}  // namespace transport
}  // namespace v0
}  // namespace psx
