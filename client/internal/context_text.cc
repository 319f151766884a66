#include "client/internal/context_text.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::client::internal {
namespace {

using google::protobuf::TextFormat;

// Prints bytes fields as a quoted lowercase hex string: tokens and GIDs are
// binary, and escaped octal says nothing to a reader.
class HexBytesPrinter : public TextFormat::FastFieldValuePrinter {
 public:
  void PrintBytes(const std::string& value,
                  TextFormat::BaseTextGenerator* generator) const override {
    generator->PrintString(
        absl::StrCat("\"", absl::BytesToHexString(value), "\""));
  }
};

}  // namespace

absl::StatusOr<std::string> DecodeBase64(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  std::string decoded;
  if (trimmed.empty() || !(absl::Base64Unescape(trimmed, &decoded) ||
                           absl::WebSafeBase64Unescape(trimmed, &decoded))) {
    return absl::InvalidArgumentError(
        "the remote context is not base64 (or is empty)");
  }
  return decoded;
}

absl::StatusOr<std::string> RemoteContextToText(absl::string_view serialized) {
  rdma::agent::v1::RemoteBuffer context;
  if (serialized.empty() ||
      !context.ParseFromArray(serialized.data(),
                              static_cast<int>(serialized.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", serialized.size(),
        " bytes given are not a serialized RemoteBuffer (truncated or not a "
        "remote context)"));
  }
  TextFormat::Printer printer;
  printer.RegisterFieldValuePrinter(
      rdma::agent::v1::RemoteBuffer::descriptor()->FindFieldByName("token"),
      new HexBytesPrinter());
  printer.RegisterFieldValuePrinter(
      rdma::agent::v1::IbverbsEndpoint::descriptor()->FindFieldByName("gid"),
      new HexBytesPrinter());
  std::string text;
  if (!printer.PrintToString(context, &text)) {
    return absl::InternalError("cannot print the remote context");
  }
  return text;
}

}  // namespace rdma_agent::client::internal
