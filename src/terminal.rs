//! Text a client chose (keys, policy names of a remote document), made safe
//! to print on an operator's terminal: every character that would act on
//! the terminal or reorder what it shows is written as a visible escape.
//!
//! Escaped: the C0 controls and DEL (ESC starts a terminal command), the C1
//! controls U+0080..=U+009F (U+009B is a one-character CSI on terminals
//! that honour 8-bit controls), the bidirectional controls (U+061C,
//! U+200E, U+200F, U+202A..=U+202E, U+2066..=U+2069: "Trojan Source", a key
//! shown in another order than its bytes), the line and paragraph
//! separators U+2028/U+2029, and the invisible U+200B..=U+200D, U+2060 and
//! U+FEFF (two keys that look alike must not print alike). A backslash is
//! doubled, so the escaped text reads back to one string only.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` must not reach a terminal as it is.
pub fn is_unsafe(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}'
        | '\u{61c}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
        | '\u{2060}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
}

/// `s` with every unsafe character written as `\xNN` (below U+0080) or
/// `\u{NNNN}`, and `\` as `\\`; borrowed when nothing needs escaping.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c == '\\' || is_unsafe(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if is_unsafe(c) && (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if is_unsafe(c) => {
                let _ = write!(out, "\\u{{{:04x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `bytes` as text for a terminal: UTF-8 escaped by `escape`, and any
/// byte that is not part of valid UTF-8 as `\xNN`.
pub fn escape_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(&escape(chunk.valid()));
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// A JSON document (as serde_json writes it) with the unsafe characters
/// that JSON allows raw in strings written as `\uNNNN` escapes instead:
/// the same document once parsed. serde_json already escapes U+0000..=U+001F;
/// everything it writes outside strings is ASCII, so only string contents
/// change.
pub fn json_ascii_safe(json: &str) -> Cow<'_, str> {
    if !json.chars().any(|c| c != '\n' && is_unsafe(c)) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 8);
    for c in json.chars() {
        if c != '\n' && is_unsafe(c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_escaped_visibly() {
        // C1 CSI, RLO, LRI..PDI, LRM/RLM, ESC, DEL, NUL, a unit separator.
        let hostile = "a\u{9b}31mb\u{202e}cba\u{2066}\u{2067}\u{2068}\u{2069}\u{200e}\u{200f}\x1b[2J\x7f\0\x1f";
        let shown = escape(hostile);
        assert!(!shown.chars().any(is_unsafe), "{shown:?}");
        assert_eq!(shown, "a\\u{009b}31mb\\u{202e}cba\\u{2066}\\u{2067}\\u{2068}\\u{2069}\\u{200e}\\u{200f}\\x1b[2J\\x7f\\x00\\x1f");
        for c in ['\u{85}', '\u{61c}', '\u{200b}', '\u{2028}', '\u{2029}', '\u{202a}', '\u{2060}', '\u{feff}', '\t', '\n', '\r'] {
            assert!(is_unsafe(c) && !escape(&c.to_string()).contains(c), "{c:?}");
        }
    }

    #[test]
    fn ordinary_text_is_left_alone_and_escapes_cannot_be_forged() {
        assert!(matches!(escape("tenant-42 éü 東京 🙂"), Cow::Borrowed("tenant-42 éü 東京 🙂")));
        // A key that spells an escape is not shown as the escaped control.
        assert_ne!(escape("\\u{202e}"), escape("\u{202e}"));
        assert_eq!(escape("\\u{202e}"), "\\\\u{202e}");
        assert_eq!(escape_bytes(b"\x0aper_tenant\xfftenant-a\x1f3"), "\\x0aper_tenant\\xfftenant-a\\x1f3");
    }

    #[test]
    fn json_keeps_its_meaning_without_raw_controls() {
        let doc = serde_json::json!({ "key": "a\u{9b}b\u{202e}c\x1b" }).to_string();
        let safe = json_ascii_safe(&doc);
        assert!(!safe.chars().any(is_unsafe), "{safe}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&safe).unwrap(), serde_json::from_str::<serde_json::Value>(&doc).unwrap());
    }
}
