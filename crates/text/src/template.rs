//! Chat templates: the GGUF's own `tokenizer.chat_template`, rendered with minijinja.

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::Error;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn template_error(e: minijinja::Error) -> Error {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template { message }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the token texts templates may refer to.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template a GGUF file carries (`tokenizer.chat_template`), with the file's BOS and EOS
    /// token texts; `None` when the file has none.
    pub fn from_header(
        h: &gguf::Header,
        tokenizer: &crate::Tokenizer,
    ) -> Result<Option<Self>, Error> {
        let Some(src) = h.get("tokenizer.chat_template").and_then(|v| v.as_str()) else {
            return Ok(None);
        };
        let text_of = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        Self::new(src, &text_of(tokenizer.bos), &text_of(tokenizer.eos)).map(Some)
    }

    /// Renders the conversation, ending with the assistant's turn opener when
    /// `add_generation_prompt` is set.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let tmpl = self.env.get_template("chat").map_err(template_error)?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
            .collect();
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone(),
            eos_token => self.eos.clone(),
        })
        .map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn chatml_with_own_system_message_matches_the_reference_prompt() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
        let out = t
            .render(
                &[
                    msg("system", "You are a helpful assistant."),
                    msg("user", "What is 2+2?"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_inserts_the_default_system_message() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let out = t.render(&[msg("user", "hi")], false).unwrap();
        assert!(out.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(out.ends_with("<|im_start|>user\nhi<|im_end|>\n"));
    }

    #[test]
    fn raise_exception_becomes_a_template_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip() }}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "  x  ")], false).unwrap(), "x");
    }
}
