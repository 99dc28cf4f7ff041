//! A mount table read line by line through one fixed buffer, for tables
//! of other namespaces, which are as big as their tenants make them: a
//! line longer than the buffer is skipped (and said to be), so that memory
//! is bounded by the cap, never by the table.
use std::io::{self, Read};

/// One line of a capped read.
#[derive(Debug, PartialEq, Eq)]
pub enum CappedLine<'a> {
    /// Without its newline.
    Line(&'a [u8]),
    /// A line longer than the cap, read past and dropped.
    TooLong,
}

/// Lines of `source`, each at most `cap` bytes with its newline.
#[derive(Debug)]
pub struct CappedLines<R> {
    source: R,
    buffer: Vec<u8>,
    start: usize,
    end: usize,
    eof: bool,
}

impl<R: Read> CappedLines<R> {
    pub fn new(source: R, cap: usize) -> Self {
        CappedLines { source, buffer: vec![0; cap.max(1)], start: 0, end: 0, eof: false }
    }

    /// The next line, None at the end.
    pub fn next_line(&mut self) -> io::Result<Option<CappedLine<'_>>> {
        loop {
            if let Some(newline) = self.buffer[self.start..self.end].iter().position(|&byte| byte == b'\n') {
                let line = self.start..self.start + newline;
                self.start += newline + 1;
                return Ok(Some(CappedLine::Line(&self.buffer[line])));
            }
            if self.eof {
                if self.start == self.end {
                    return Ok(None);
                }
                let line = self.start..self.end;
                self.start = self.end;
                return Ok(Some(CappedLine::Line(&self.buffer[line])));
            }
            if self.start == 0 && self.end == self.buffer.len() {
                self.skip_line()?;
                return Ok(Some(CappedLine::TooLong));
            }
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            self.fill()?;
        }
    }

    /// Reads more after what the buffer holds; notes the end of the source.
    fn fill(&mut self) -> io::Result<()> {
        let read = loop {
            match self.source.read(&mut self.buffer[self.end..]) {
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                read => break read?,
            }
        };
        self.end += read;
        self.eof = read == 0;
        Ok(())
    }

    /// Drops the rest of a line that filled the buffer, up to and with its
    /// newline.
    fn skip_line(&mut self) -> io::Result<()> {
        loop {
            self.start = 0;
            self.end = 0;
            self.fill()?;
            if self.eof {
                return Ok(());
            }
            if let Some(newline) = self.buffer[..self.end].iter().position(|&byte| byte == b'\n') {
                self.start = newline + 1;
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads 3 bytes at a time, as a pipe or a busy kernel may hand them.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(3).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn lines(text: &[u8], cap: usize) -> Vec<Option<String>> {
        let mut lines = CappedLines::new(Trickle(text), cap);
        let mut out = Vec::new();
        while let Some(line) = lines.next_line().unwrap() {
            out.push(match line {
                CappedLine::Line(line) => Some(String::from_utf8(line.to_vec()).unwrap()),
                CappedLine::TooLong => None,
            });
        }
        out
    }

    #[test]
    fn a_line_over_the_cap_is_skipped_and_said_to_be() {
        let long = "x".repeat(40);
        let text = format!("short\n{long}\nafter\n{long}");
        let seen = lines(text.as_bytes(), 16);
        assert_eq!(seen, vec![Some("short".into()), None, Some("after".into()), None]);
    }

    #[test]
    fn a_line_that_fills_the_cap_with_its_newline_is_kept() {
        let text = "0123456789abcde\n0123456789abcdef\nend";
        let seen = lines(text.as_bytes(), 16);
        assert_eq!(seen, vec![Some("0123456789abcde".into()), None, Some("end".into())]);
    }

    #[test]
    fn empty_and_final_lines() {
        assert!(lines(b"", 8).is_empty());
        assert_eq!(lines(b"a\n\nb", 8), vec![Some("a".into()), Some(String::new()), Some("b".into())]);
    }
}
